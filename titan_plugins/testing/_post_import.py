"""Run a callback right after a module executes, before anyone ``from``-imports its names.

The CPU harness must fix megatron attributes that other megatron modules copy with
``from x import f`` at import time; patching ``x.f`` later would not reach those copies. This
uses the core's one post-import mechanism (:class:`titan_plugins.patching.watcher.
PostImportWatcher`) with a table of one-shot callbacks.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType

from titan_plugins.patching.watcher import PostImportWatcher

Callback = Callable[[ModuleType], None]

_LOCK = threading.Lock()
_PENDING: dict[str, list[Callback]] = {}


def _callback_for(fullname: str) -> Callback | None:
    if fullname not in _PENDING:
        return None

    def run(module: ModuleType) -> None:
        with _LOCK:
            callbacks = _PENDING.pop(fullname, [])
        for callback in callbacks:
            callback(module)

    return run


_WATCHER = PostImportWatcher(_callback_for)


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` right after module ``name`` executes (at once if imported)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _LOCK:
        _PENDING.setdefault(name, []).append(callback)
    _WATCHER.install()
