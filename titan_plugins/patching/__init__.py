"""Declarative lazy patches: records, the engine that applies them, the import watcher.

Plugin authors need :class:`Patch`, :class:`Signature` and :data:`SUPPORTED_MEGATRON`; the
status names are what reports show.
"""

from titan_plugins.patching.engine import PatchEngine, PatchError
from titan_plugins.patching.gates import SUPPORTED_MEGATRON
from titan_plugins.patching.record import MISSING, Patch
from titan_plugins.patching.signature import MODULE, Signature
from titan_plugins.patching.status import APPLIED, FAILED, PENDING, SKIPPED, STATUSES
from titan_plugins.patching.watcher import PatchWatcher

__all__ = [
    "APPLIED",
    "FAILED",
    "MISSING",
    "MODULE",
    "PENDING",
    "SKIPPED",
    "STATUSES",
    "SUPPORTED_MEGATRON",
    "Patch",
    "PatchEngine",
    "PatchError",
    "PatchWatcher",
    "Signature",
]
