"""A plugin that fails at import: the registry must report it and keep the others working."""

raise RuntimeError("titan_broken_plugin is broken on purpose")
