"""The automatic channels' first step: arm a one-shot import trigger, for almost nothing.

The ``torch.backends`` entry point runs inside every ``import torch`` of the environment, most
of them in processes that never touch Megatron, so this module imports only the standard
library: no manager, no engine, no plugin. The trigger fires when the first module under
``megatron`` is about to run (a lookup alone does not fire it); only then is
:mod:`titan_plugins.activation` imported and started. Reading the switches here is deliberately
raw (off / not off): a malformed value is reported, or raised under STRICT, by the activation,
out of ``import megatron`` and never out of ``import torch``.
"""

from __future__ import annotations

import _imp
import importlib.abc
import os
import sys
import time
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from typing import Any

from titan_plugins import arming
from titan_plugins.arming import Armed, armed, disarm
from titan_plugins.finders import find_elsewhere

TRIGGER_PREFIXES = ("megatron",)
_OFF = ("0", "false", "no", "off")


class ImportTrigger(importlib.abc.MetaPathFinder):
    """One-shot: calls ``on_trigger()`` when the first module under ``prefixes`` is about to
    execute, then takes itself off ``sys.meta_path``.

    It fires at execution, not at lookup: ``importlib.util.find_spec("megatron")`` (an
    availability check in many libraries, ``titan-plugins list``) finds the module without
    loading plugins; a namespace package (no code to run) passes it on to its first submodule.
    An exception from ``on_trigger`` propagates to that import statement (STRICT mode uses it
    to stop ``import megatron`` with a clear message).
    """

    def __init__(self, prefixes: tuple[str, ...], on_trigger: Callable[[], None]) -> None:
        self._prefixes = prefixes
        self._on_trigger: Callable[[], None] | None = on_trigger

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if self._on_trigger is None or fullname.split(".", 1)[0] not in self._prefixes:
            return None
        spec = find_elsewhere(self, fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not found, a namespace package, or a legacy loader: stay armed
        spec.loader = _FiringLoader(loader, self, path, target)
        return spec

    def fire(self) -> bool:
        """Run ``on_trigger`` once and take the trigger off ``sys.meta_path``; False when it
        had already fired or was disarmed."""
        trigger, self._on_trigger = self._on_trigger, None
        self.remove()
        if trigger is None:
            return False
        # Under the global import lock, as a finder's lookup runs: another thread's import
        # waits for the activation instead of running a megatron module before the watcher.
        _imp.acquire_lock()
        try:
            trigger()
        finally:
            _imp.release_lock()
        return True

    @property
    def armed(self) -> bool:
        """Whether the trigger has not fired (nor been disarmed) yet."""
        return self._on_trigger is not None

    def disarm(self) -> None:
        """Drop the trigger (activation happened another way)."""
        self._on_trigger = None
        self.remove()

    def install(self) -> None:
        """Put the trigger first on ``sys.meta_path`` (once)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        """Take the trigger off ``sys.meta_path``."""
        while self in sys.meta_path:
            sys.meta_path.remove(self)


class _FiringLoader(importlib.abc.Loader):
    """The real loader of the first triggering module, firing the trigger before it executes."""

    def __init__(self, loader: Any, trigger: ImportTrigger, path: Any, target: Any) -> None:
        self._loader = loader
        self._trigger = trigger
        self._where = (path, target)

    def create_module(self, spec: ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._trigger.fire()
        # The activation (now, or since this module was found) may have installed a patch
        # watcher for this very module: ask the finders again, so it wraps the loader that
        # runs it (the same file only).
        loader = self._loader
        spec = getattr(module, "__spec__", None)
        again = find_elsewhere(self._trigger, module.__name__, *self._where)
        if (
            again is not None
            and hasattr(again.loader, "exec_module")
            and again.origin == getattr(spec, "origin", None)
        ):
            loader = again.loader
        try:
            loader.exec_module(module)
        finally:
            # leave no trace: the module's loader is the one that ran it
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = loader
            if spec is not None and spec.loader is self:
                spec.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _off(var: str) -> bool:
    return (os.environ.get(var) or "").strip().lower() in _OFF


def arm(channel: str, prefixes: tuple[str, ...] | None = None) -> None:
    """Arm lazy activation for ``channel`` (``torch.backends`` or ``titan-run``); idempotent,
    never raises. ``TITAN_PLUGINS=0`` and ``TITAN_PLUGINS_AUTOLOAD=0`` leave it unarmed.

    If megatron is already importing (``import megatron.core`` imported torch, whose entry
    point got us here), the trigger fires at megatron's next module.
    """
    try:
        known = arming.armed()
        if known is not None and (known.fired or (known.trigger and known.trigger.armed)):
            return
        record = arming.record(Armed(channel))
        if _off("TITAN_PLUGINS"):
            record.state = "off: TITAN_PLUGINS=0"
            return
        if _off("TITAN_PLUGINS_AUTOLOAD"):
            record.state = "off: TITAN_PLUGINS_AUTOLOAD=0"
            return
        prefixes = prefixes or TRIGGER_PREFIXES
        record.late = any(name.split(".", 1)[0] in prefixes for name in list(sys.modules))
        record.trigger = ImportTrigger(prefixes, _fire)
        record.trigger.install()
        record.state = (
            "armed late: megatron was already importing; loads at its next module"
            if record.late
            else "armed: plugins load when megatron is first imported"
        )
    except Exception as err:  # never let import torch fail because of us
        known = arming.armed()
        if known is not None:
            known.state = f"failed: {type(err).__name__}: {err}"
        print(f"[titan_plugins] WARNING autoload failed: {err}", file=sys.stderr)


def _fire() -> None:
    record = arming.armed()
    assert record is not None
    record.fired = True
    started = time.perf_counter()
    try:
        from titan_plugins import activation

        activation.start_armed(record)
    finally:
        record.fire_seconds = time.perf_counter() - started


__all__ = ["Armed", "ImportTrigger", "arm", "armed", "disarm"]
