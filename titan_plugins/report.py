"""The registry's state as one JSON-serialisable dict, for ``list``, ``report`` and logs."""

from __future__ import annotations

import importlib.util
from typing import Any

from titan_plugins import activation, host_memory
from titan_plugins.hosts import HOSTS
from titan_plugins.jsonable import jsonable
from titan_plugins.manager import BUILTIN, ENABLED
from titan_plugins.patching import FAILED, OTHER_LINE, SKIPPED, origin
from titan_plugins.version import __version__

MEGATRON = HOSTS["megatron"]


def collect(state: activation.Activation | None = None) -> dict[str, Any]:
    """Snapshot of installed plugins, their state, hooks, patches and own reports, and where
    Megatron comes from (read from its files; megatron is not imported for it)."""
    state = state or activation.current()
    out: dict[str, Any] = {
        "core_version": __version__,
        "megatron": megatron_origin(),
        "hosts": host_descriptions(),
        "autoload": activation.autoload_state(),
        "active": bool(state and state.is_active),
        "channel": state.channel if state else None,
        "inactive_reason": state.inactive_reason if state else "not activated in this process",
        "problems": list(state.problems) if state else [],
        "host_memory": host_memory.usage(),
        "plugins": [],
    }
    if state is None or state.manager is None:
        return out
    pm, engine = state.manager, state.engine
    patches = engine.patches() if engine else []
    for name, record in pm.records.items():
        entry = record.as_dict()
        plugin = pm.get_plugin(name)
        entry["hooks"] = sorted(h.name for h in pm.get_hookcallers(plugin) or []) if plugin else []
        entry["patches"] = [p.as_dict() for p in patches if p.plugin == name]
        _mark_inactive(entry)
        entry["report"] = _own_dict(plugin, "titan_report") if plugin else {}
        entry["effects"] = _own_dict(plugin, "titan_effects") if plugin else {}
        out["plugins"].append(entry)
    out["core_patches"] = [p.as_dict() for p in patches if p.plugin == BUILTIN]
    return out


def _mark_inactive(entry: dict[str, Any]) -> None:
    """An enabled plugin none of whose patches could apply (e.g. an unsupported Megatron) is
    shown as inactive, with the first reason, rather than "enabled"."""
    # a patch for a host this process does not run (weight_sync's SGLang side in a trainer,
    # even where SGLang is installed or bundled) says nothing about whether the plugin works here
    # nor does an optional patch into a framework this process does not have (weight_sync's
    # slime patch in a plain torchrun job, whose trainer side is an API)
    patches = [p for p in entry["patches"] if not _elsewhere(p)]
    if entry["state"] != ENABLED or not patches:
        return
    if all(p["status"] in (SKIPPED, FAILED, OTHER_LINE) for p in patches):
        entry["state"] = "inactive"
        entry["reason"] = f"no patch applies: {patches[0]['detail']}"


def _elsewhere(patch: dict[str, Any]) -> bool:
    """Whether a patch record serves code this process does not run: a host it does not run,
    or (an optional patch) a framework that is not installed here, or whose module does not
    import here (the framework could not run it either; the skip keeps the import error)."""
    top = _top_package(patch["target"])
    if _other_host(top):
        return True
    if not patch.get("optional"):
        return False
    unimportable = patch["status"] == SKIPPED and str(patch.get("detail", "")).startswith("import ")
    return unimportable or _absent(top)


def _top_package(target: str) -> str:
    """``module:attr`` -> the module's top-level package."""
    return target.split(":", 1)[0].split(".", 1)[0]


def _other_host(top: str) -> bool:
    """Whether the package ``top`` belongs to a host this process does not run."""
    for host in HOSTS.values():
        if host.PACKAGE.split(".", 1)[0] == top:
            return not host.here()
    return False


def _absent(top: str) -> bool:
    """Whether the top-level package ``top`` cannot be found here (nothing imported)."""
    try:
        return importlib.util.find_spec(top) is None
    except (ImportError, ValueError):
        return True


def megatron_origin() -> dict[str, Any]:
    """Path, version (``megatron.core.package_info``), kind and shadowed copies of the
    ``megatron.core`` this process imports (or would import), plus a one-line summary."""
    try:
        found = origin.describe(MEGATRON.PACKAGE, MEGATRON.DISTRIBUTION)
    except Exception as err:  # a report must never fail because of an odd environment
        return {"summary": f"megatron.core: origin unknown ({type(err).__name__}: {err})"}
    return {**found.as_dict(), "summary": found.summary()}


def host_descriptions() -> dict[str, dict[str, Any]]:
    """Each host room's own description (SGLang: its version, and which SGLang process this
    is); hosts with nothing to add are left out."""
    out: dict[str, dict[str, Any]] = {}
    for name, host in HOSTS.items():
        try:
            found = host.describe()
        except Exception as err:  # a report must never fail because of an odd environment
            found = {"summary": f"unknown ({type(err).__name__}: {err})"}
        if found:
            out[name] = found
    return out


def _own_dict(plugin: Any, hook: str) -> dict[str, Any]:
    """One plugin's answer to a dict-returning hook, as strict-JSON values (a plugin's tuple keys
    or NaNs must not break the report's JSON); a raising plugin yields its error."""
    function = getattr(plugin, hook, None)
    if function is None:
        return {}
    try:
        return jsonable(dict(function() or {}))
    except Exception as err:
        return {"error": f"{hook} raised {type(err).__name__}: {err}"}


def effects() -> dict[str, dict[str, Any]]:
    """Every active plugin's ``titan_effects`` in this process, keyed by plugin name."""
    state = activation.active()
    if state is None or state.manager is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, plugin in state.manager.list_name_plugin():
        if name != BUILTIN and plugin is not None:
            found = _own_dict(plugin, "titan_effects")
            if found:
                out[name] = found
    return out
