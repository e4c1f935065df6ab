"""Activate one installed plugin for the duration of a test, through the real engine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from importlib import metadata

from titan_plugins.activation import Activation, use
from titan_plugins.manager import ENABLED, ENTRY_POINT_GROUP, TitanPluginManager, get_plugin_manager
from titan_plugins.patching import PatchEngine


@contextlib.contextmanager
def environ(env: dict[str, str] | None) -> Iterator[None]:
    """Set environment variables for the block and restore the previous values after."""
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fresh_manager(
    only: list[str] | None = None, entry_points: list[metadata.EntryPoint] | None = None
) -> TitanPluginManager:
    """A new manager, discovering installed plugins (or the given entry points)."""
    return get_plugin_manager(only=only, entry_points=entry_points)


@contextlib.contextmanager
def plugin_active(
    name: str | Sequence[str], env: dict[str, str] | None = None
) -> Iterator[PatchEngine]:
    """Apply the installed plugin ``name`` (and only it, with the core) inside the block; a list
    of names applies those plugins together (composition tests).

    Sets ``env``, starts a private :class:`~titan_plugins.activation.Activation` limited to the
    plugin (already-imported modules are patched at once, later imports by its watcher), makes
    it the process's activation for the block, and on exit stops it (every patch undone) and
    restores the environment. Raises if the plugin is not installed, is disabled by the switches
    in ``env``, or failed to load or register.

    :yield: the engine, whose ``patches()`` tell the status of each record.
    """
    names = [name] if isinstance(name, str) else list(name)
    with environ(env):
        eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name in names]
        missing = sorted(set(names) - {ep.name for ep in eps})
        if missing:
            raise LookupError(
                f"plugin(s) {', '.join(missing)} not installed (entry-point group "
                f"{ENTRY_POINT_GROUP})"
            )
        state = Activation("testing.plugin_active", only=names, entry_points=eps)
        try:
            state.start()
            for each in names:
                record = state.manager.records.get(each) if state.manager else None
                if record is None or record.state != ENABLED:
                    why = f"{record.state}: {record.reason}" if record else state.detail
                    raise RuntimeError(f"plugin {each!r} is {why}")
            if state.errors:
                raise RuntimeError("; ".join(state.errors))
            with use(state):
                yield state.engine
        finally:
            state.stop()
