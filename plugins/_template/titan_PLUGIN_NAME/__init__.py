"""Titan plugin PLUGIN_NAME. Importing this package has no side effect."""
