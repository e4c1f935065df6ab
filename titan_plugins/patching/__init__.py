"""Declarative lazy patches: records, the engine that applies them, the import watcher.

Plugin authors need :class:`Patch` and :class:`Signature` (the gates of a host's release lines
live in its room: ``from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON,
megatron_lines``); the status names are what reports show.
"""

from titan_plugins.patching.engine import PatchEngine, PatchError
from titan_plugins.patching.record import MISSING, Patch
from titan_plugins.patching.signature import MODULE, Signature
from titan_plugins.patching.status import (
    APPLIED,
    FAILED,
    OTHER_LINE,
    PENDING,
    SKIPPED,
    STATUSES,
)
from titan_plugins.patching.watcher import PatchWatcher

__all__ = [
    "APPLIED",
    "FAILED",
    "MISSING",
    "MODULE",
    "OTHER_LINE",
    "PENDING",
    "SKIPPED",
    "STATUSES",
    "Patch",
    "PatchEngine",
    "PatchError",
    "PatchWatcher",
    "Signature",
]
