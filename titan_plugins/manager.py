"""``get_plugin_manager()``: the pluggy manager, with discovery that never breaks the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from titan_plugins import hookspecs
from titan_plugins._log import logger
from titan_plugins.switches import disabled_reasons

ENTRY_POINT_GROUP = "titan_plugins"
ENABLED, DISABLED, FAILED = "enabled", "disabled", "failed"
BUILTIN = "titan-core"


@dataclass
class PluginRecord:
    """What discovery found for one entry point, and what became of it."""

    name: str
    distribution: str = ""
    version: str = ""
    value: str = ""
    state: str = ENABLED
    reason: str = ""
    plugin: Any = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.value,
            "state": self.state,
            "reason": self.reason,
        }


class TitanPluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers every discovered plugin's record."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.records: dict[str, PluginRecord] = {}


def discover() -> list[metadata.EntryPoint]:
    """The ``titan_plugins`` entry points of the installed distributions."""
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def get_plugin_manager(
    only: list[str] | None = None, entry_points: list[metadata.EntryPoint] | None = None
) -> TitanPluginManager:
    """Build the manager: hookspecs, built-ins, then the enabled installed plugins.

    Disabled plugins are blocked before anything is loaded; a plugin whose import raises, or
    that implements hooks this core does not know, is recorded as failed and left out while the
    others load. Nothing here raises for a plugin's fault.

    :param only: an explicit allowlist of entry-point names (``apply(only=...)``).
    :param entry_points: override discovery (tests); defaults to :func:`discover`.
    """
    from titan_plugins import builtin

    pm = TitanPluginManager()
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name=BUILTIN)
    eps = discover() if entry_points is None else entry_points
    by_name: dict[str, metadata.EntryPoint] = {}
    for ep in eps:
        dist = getattr(ep, "dist", None)
        record = PluginRecord(
            ep.name,
            getattr(dist, "name", "") or "",
            getattr(dist, "version", "") or "",
            ep.value,
        )
        if ep.name in by_name or ep.name == BUILTIN:
            record.state, record.reason = FAILED, "duplicate plugin name (another distribution)"
            pm.records[f"{ep.name}@{record.distribution}"] = record
            continue
        by_name[ep.name] = ep
        pm.records[ep.name] = record
    for name, reason in disabled_reasons(by_name, only).items():
        pm.set_blocked(name)
        pm.records[name].state, pm.records[name].reason = DISABLED, reason
    for name, ep in by_name.items():
        if pm.is_blocked(name):
            continue
        _load_one(pm, pm.records[name], ep)
    _drop_unknown_hooks(pm)
    return pm


def _load_one(pm: TitanPluginManager, record: PluginRecord, ep: metadata.EntryPoint) -> None:
    try:
        plugin = ep.load()
        pm.register(plugin, name=record.name)
    except Exception as err:  # a broken plugin must not break import torch or the others
        record.state = FAILED
        record.reason = f"load failed: {type(err).__name__}: {err}"
        logger.warning("plugin %s not loaded: %s", record.name, record.reason)
        return
    record.plugin = plugin


def _drop_unknown_hooks(pm: TitanPluginManager) -> None:
    """Unregister plugins whose hooks this core does not define (newer plugin, older core)."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as err:
            plugin = err.plugin
            name = pm.get_name(plugin) or "?"
            unknown = sorted(
                hook
                for hook in dir(pm.hook)
                if hook.startswith("titan_")
                and not pm.hook.__dict__[hook].has_spec()
                and any(impl.plugin is plugin for impl in pm.hook.__dict__[hook].get_hookimpls())
            )
            pm.unregister(plugin)
            record = pm.records.get(name)
            if record is not None:
                record.state = FAILED
                record.reason = (
                    f"implements hooks this core does not know ({', '.join(unknown)}); "
                    "upgrade titan-plugins"
                )
                logger.warning("plugin %s unregistered: %s", name, record.reason)
