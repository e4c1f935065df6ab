"""Activate one installed plugin for the duration of a test, through the real engine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from importlib import metadata

from titan_plugins import activation
from titan_plugins.activation import Activation, register_patches
from titan_plugins.manager import ENTRY_POINT_GROUP, TitanPluginManager, get_plugin_manager
from titan_plugins.patching import PatchEngine, PatchWatcher


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
def plugin_active(name: str, env: dict[str, str] | None = None) -> Iterator[PatchEngine]:
    """Apply the installed plugin ``name`` (and only it) inside the block.

    Sets ``env``, builds a fresh manager, registers the plugin's patches in a private engine
    (already-imported modules are patched at once, later imports by a private watcher), and on
    exit undoes every patch and restores the environment. Raises if the plugin is not
    installed, is disabled by the switches in ``env``, or failed to load.

    :yield: the engine, whose ``patches()`` tell the status of each record.
    """
    with environ(env):
        eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not eps:
            raise LookupError(
                f"plugin {name!r} is not installed (entry-point group {ENTRY_POINT_GROUP})"
            )
        pm = fresh_manager(only=[name], entry_points=eps)
        record = pm.records[name]
        if record.state != "enabled":
            raise RuntimeError(f"plugin {name!r} is {record.state}: {record.reason}")
        engine = PatchEngine()
        errors: list[str] = []
        watcher = PatchWatcher(engine)
        watcher.install()
        previous = activation._ACTIVE
        # Plugins reach their manager through active_manager() (backend hooks, reports).
        activation._ACTIVE = Activation(
            "testing.plugin_active", manager=pm, engine=engine, watcher=watcher
        )
        try:
            register_patches(pm, engine, errors)
            if errors:
                raise RuntimeError("; ".join(errors))
            engine.apply_ready()
            yield engine
        finally:
            activation._ACTIVE = previous
            engine.undo()
            watcher.remove()
