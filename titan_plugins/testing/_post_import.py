"""Run a callback right after a module executes, before anyone ``from``-imports its names.

The CPU harness must fix megatron attributes that other megatron modules copy with
``from x import f`` at import time; patching ``x.f`` later would not reach those copies. This is a
deliberately tiny, harness-private watcher (the plugin patch engine has its own).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

Callback = Callable[[ModuleType], None]

_LOCK = threading.Lock()
_PENDING: dict[str, list[Callback]] = {}
_BUSY = threading.local()


def _find_with_others(
    me: importlib.abc.MetaPathFinder,
    fullname: str,
    path: Sequence[str] | None,
    target: ModuleType | None,
) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so callbacks run after ``exec_module``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        # Busy flag: other watchers (the plugin engine's) ask every finder too; without it two
        # watchers would recurse into each other.
        if fullname not in _PENDING or getattr(_BUSY, "active", False):
            return None
        _BUSY.active = True
        try:
            spec = _find_with_others(self, fullname, path, target)
        finally:
            _BUSY.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            with _LOCK:
                callbacks = _PENDING.pop(fullname, [])
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` right after module ``name`` executes (at once if imported)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _LOCK:
        _PENDING.setdefault(name, []).append(callback)
        if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder())
