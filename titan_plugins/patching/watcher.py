"""The ``sys.meta_path`` watcher: patch a module right after its body executes.

Applying there (not later) matters: modules that ``from x import f`` afterwards copy the patched
``f``. The watcher finds the real spec through the other finders and wraps its loader; it never
imports anything itself.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from titan_plugins.patching.engine import PatchEngine


class _PostExecLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs ``after(module)``."""

    def __init__(self, loader: Any, after: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PatchWatcher(importlib.abc.MetaPathFinder):
    """Meta-path finder bound to one engine; optional ``on_trigger`` for lazy activation."""

    def __init__(
        self,
        engine: PatchEngine | None,
        trigger_prefixes: tuple[str, ...] = (),
        on_trigger: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self._trigger_prefixes = trigger_prefixes
        self._on_trigger = on_trigger
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            if self._on_trigger is not None and fullname.split(".", 1)[0] in self._trigger_prefixes:
                trigger, self._on_trigger = self._on_trigger, None
                trigger()
            if self.engine is None:
                return None
            if self.engine.deferred:  # modules that were mid-import at activation
                self.engine.retry_deferred()
            if fullname not in self.engine.watched_modules():
                return None
            spec = self._find_with_others(fullname, path, target)
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        engine = self.engine
        spec.loader = _PostExecLoader(spec.loader, lambda m: engine.apply_module(m, fresh=True))
        return spec

    def _find_with_others(self, fullname: str, path: Any, target: Any) -> ModuleSpec | None:
        for finder in sys.meta_path:
            # Other watchers are asked too (their busy flag stops recursion), so two engines
            # watching one module both get their post-exec callback.
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def disarm(self) -> None:
        """Drop the lazy-activation trigger (activation happened another way)."""
        self._on_trigger = None

    def install(self) -> None:
        """Put the watcher first on ``sys.meta_path`` (once)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        """Take the watcher off ``sys.meta_path``."""
        while self in sys.meta_path:
            sys.meta_path.remove(self)
