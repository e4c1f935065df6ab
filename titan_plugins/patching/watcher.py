"""The one post-import mechanism: ``sys.meta_path`` finders that act right after a module body
executes (the one-shot trigger of lazy activation, which must stay standard-library only, is
:class:`titan_plugins.autoload.ImportTrigger` and shares
:func:`titan_plugins.finders.find_elsewhere`).

Applying patches there (not later) matters: modules that ``from x import f`` afterwards copy the
patched ``f``. A watcher finds the real spec through the other finders and wraps its loader; it
never imports anything itself. The patch engine's :class:`PatchWatcher` and the test harness's
``when_imported`` are both :class:`PostImportWatcher` instances.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from titan_plugins.finders import find_elsewhere
from titan_plugins.patching.engine import PatchEngine

AfterExec = Callable[[ModuleType], None]


class _PostExecLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs ``after(module)``."""

    def __init__(self, loader: Any, after: AfterExec) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportWatcher(importlib.abc.MetaPathFinder):
    """Runs a callback right after a watched module executes.

    :param callback_for: returns the callback for a module name, or None when not watched
        (called on every import in the process: keep it O(1)).
    """

    def __init__(self, callback_for: Callable[[str], AfterExec | None]) -> None:
        self._callback_for = callback_for
        # Watchers consult the other finders, watchers included (so two watchers of one module
        # both get their callback); a per-thread busy flag of each stops the recursion.
        self._busy = threading.local()

    def before_lookup(self) -> None:
        """Hook for subclasses: runs on every import before the watched-name lookup."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            self.before_lookup()
            after = self._callback_for(fullname)
            if after is None:
                return None
            spec = find_elsewhere(self, fullname, path, target)
        finally:
            self._busy.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostExecLoader(spec.loader, after)
        return spec

    def install(self) -> None:
        """Put the watcher first on ``sys.meta_path`` (once)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        """Take the watcher off ``sys.meta_path``."""
        while self in sys.meta_path:
            sys.meta_path.remove(self)


class PatchWatcher(PostImportWatcher):
    """The engine's watcher: patches a watched module right after it executes."""

    def __init__(self, engine: PatchEngine) -> None:
        self.engine = engine
        super().__init__(self._callback)

    def _callback(self, fullname: str) -> AfterExec | None:
        if fullname not in self.engine.watched_modules():
            return None
        engine = self.engine
        return lambda module: engine.apply_module(module, fresh=True)

    def before_lookup(self) -> None:
        if self.engine.deferred:  # modules that were mid-import at activation
            self.engine.retry_deferred()
