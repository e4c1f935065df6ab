"""Declarative lazy patches: records, the engine that applies them, the import watcher."""

from titan_plugins.patching.engine import PatchEngine, PatchError
from titan_plugins.patching.record import APPLIED, FAILED, MISSING, PENDING, SKIPPED, Patch
from titan_plugins.patching.watcher import PatchWatcher

__all__ = [
    "APPLIED",
    "FAILED",
    "MISSING",
    "PENDING",
    "SKIPPED",
    "Patch",
    "PatchEngine",
    "PatchError",
    "PatchWatcher",
]
