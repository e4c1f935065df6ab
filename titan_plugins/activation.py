"""Activation: build the manager, register every enabled plugin's patches, watch imports.

Three channels reach this module: the ``torch.backends`` entry point (:func:`autoload`, lazy:
the plugins load when ``megatron`` is first imported, so processes that never touch Megatron pay
almost nothing), an explicit :func:`apply`, and the ``titan-run`` launcher.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_plugins import switches
from titan_plugins._log import DEBUG_HINT, configure, logger
from titan_plugins.patching.engine import PatchEngine
from titan_plugins.patching.watcher import PatchWatcher

if TYPE_CHECKING:
    from titan_plugins.manager import TitanPluginManager
    from titan_plugins.patching.record import Patch

TRIGGER_PREFIXES = ("megatron",)


@dataclass
class Activation:
    """One activation of the registry in this process."""

    channel: str
    manager: TitanPluginManager | None = None
    engine: PatchEngine | None = None
    watcher: PatchWatcher | None = None
    inactive_reason: str = ""
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


_ACTIVE: Activation | None = None
_AUTOLOAD: dict[str, Any] = {"ran": False, "state": "not run in this process"}


def active() -> Activation | None:
    """The current activation, if any."""
    return _ACTIVE


def active_manager() -> TitanPluginManager | None:
    """The pluggy manager of the current activation, or None."""
    return _ACTIVE.manager if _ACTIVE else None


def autoload_state() -> dict[str, Any]:
    """Whether the torch.backends channel ran in this process, and what it did."""
    return {key: value for key, value in _AUTOLOAD.items() if key != "watcher"}


def activate(
    channel: str, only: list[str] | None = None, watcher: PatchWatcher | None = None
) -> Activation:
    """Activate once per process; later calls return the existing activation.

    :param channel: "torch.backends", "apply" or "titan-run" (shown in reports).
    :param only: explicit allowlist of plugin names.
    :param watcher: an already-installed watcher to bind the engine to (lazy autoload).
    """
    global _ACTIVE
    if _ACTIVE is not None and _ACTIVE.engine is not None:
        return _ACTIVE
    configure()
    started = time.perf_counter()
    if not switches.master_enabled():
        _ACTIVE = Activation(channel, inactive_reason="TITAN_PLUGINS=0")
        return _ACTIVE
    from titan_plugins.manager import get_plugin_manager

    pm = get_plugin_manager(only=only)
    if switches.env_bool("TITAN_PLUGINS_TRACE", False):
        pm.add_hookcall_monitoring(
            lambda name, impls, kw: logger.warning("hook %s(%s)", name, ", ".join(kw)),
            lambda outcome, name, impls, kw: None,
        )
    engine = PatchEngine()
    state = Activation(channel, manager=pm, engine=engine)
    _ACTIVE = state
    register_patches(pm, engine, state.errors)
    state.watcher = watcher or PatchWatcher(engine)
    state.watcher.engine = engine
    state.watcher.install()
    engine.apply_ready()
    state.seconds = time.perf_counter() - started
    logger.debug("activated via %s in %.1f ms", channel, state.seconds * 1e3)
    return state


def register_patches(pm: TitanPluginManager, engine: PatchEngine, errors: list[str]) -> None:
    """Call each plugin's ``titan_register_patches`` on its own, so one failing plugin is
    withdrawn (patches undone, reported) while the others keep theirs."""
    from titan_plugins.manager import FAILED

    for impl in pm.hook.titan_register_patches.get_hookimpls():  # registration order
        name = impl.plugin_name

        def register(patch: Patch, _name: str = name) -> None:
            engine.register(patch, plugin=_name)

        try:
            impl.function(register=register)
        except Exception as err:
            from titan_plugins.patching.engine import PatchError

            if isinstance(err, PatchError):
                raise
            engine.withdraw(name)
            message = f"titan_register_patches raised {type(err).__name__}: {err}"
            errors.append(f"{name}: {message}")
            record = pm.records.get(name)
            if record is not None:
                record.state, record.reason = FAILED, message
            logger.warning("plugin %s failed: %s", name, message)


def apply(only: list[str] | None = None) -> Activation:
    """Explicit activation (``import titan_plugins; titan_plugins.apply()``); idempotent.

    Works with ``TITAN_PLUGINS_AUTOLOAD=0``; honours ``TITAN_PLUGINS=0`` and the other switches.
    """
    watcher = _ACTIVE.watcher if _ACTIVE is not None else _AUTOLOAD.get("watcher")
    if watcher is not None:
        watcher.disarm()  # explicit activation wins over an armed lazy trigger
    return activate("apply", only=only, watcher=watcher)


def undo() -> list[str]:
    """Undo every patch that is still ours and deactivate.

    :return: targets left alone because something else rebound them after us.
    """
    global _ACTIVE
    if _ACTIVE is None:
        return []
    left = _ACTIVE.engine.undo() if _ACTIVE.engine else []
    if _ACTIVE.watcher is not None:
        _ACTIVE.watcher.remove()
    _ACTIVE = None
    return left


def autoload() -> None:
    """Body of the torch.backends entry point. Never raises (a raise here breaks every
    ``import torch`` in the environment) and never imports megatron."""
    _AUTOLOAD["ran"] = True
    arm("torch.backends")


def arm(channel: str) -> None:
    """Arm lazy activation for ``channel`` (torch.backends or titan-run); idempotent, never
    raises. ``TITAN_PLUGINS_AUTOLOAD=0`` turns off every automatic channel; only an explicit
    :func:`apply` ignores it."""
    try:
        if "watcher" in _AUTOLOAD or (_ACTIVE is not None and _ACTIVE.engine is not None):
            return
        if not switches.master_enabled():
            _AUTOLOAD["state"] = "off: TITAN_PLUGINS=0"
            return
        if not switches.autoload_enabled():
            _AUTOLOAD["state"] = "off: TITAN_PLUGINS_AUTOLOAD=0"
            return
        if any(prefix in sys.modules for prefix in TRIGGER_PREFIXES):
            activate(channel)
            _AUTOLOAD["state"] = "activated (megatron already importing)"
            return
        watcher = PatchWatcher(None, TRIGGER_PREFIXES, lambda: _lazy_trigger(channel))
        _AUTOLOAD["watcher"] = watcher
        _AUTOLOAD["channel"] = channel
        watcher.install()
        _AUTOLOAD["state"] = "armed: plugins load when megatron is first imported"
    except Exception as err:  # never let import torch fail because of us
        _AUTOLOAD["state"] = f"failed: {type(err).__name__}: {err}"
        try:
            configure()
            logger.warning("autoload failed (%s); %s", _AUTOLOAD["state"], DEBUG_HINT)
            logger.debug("autoload traceback", exc_info=True)
        except Exception:
            pass


def _lazy_trigger(channel: str) -> None:
    try:
        activate(channel, watcher=_AUTOLOAD.get("watcher"))
        _AUTOLOAD["state"] = "activated on first megatron import"
    except Exception as err:
        from titan_plugins.patching.engine import PatchError

        _AUTOLOAD["state"] = f"failed: {type(err).__name__}: {err}"
        if isinstance(err, PatchError):
            raise  # STRICT mode asked for errors
        logger.warning("activation failed (%s); %s", _AUTOLOAD["state"], DEBUG_HINT)
