"""What pp_rdma moved in this process (``titan_effects``): counted as the transfers complete.

Receives are counted at the rank that knows the bytes landed, by the path they took: one-sided
Mooncake reads, inline control frames (small CPU tensors), or the torch.distributed fallback
(counted when posted: the fallback's completion belongs to torch).
"""

from __future__ import annotations

import threading
from collections import Counter

_LOCK = threading.Lock()
_COUNTS: Counter[str] = Counter()


def count(path: str, nbytes: int) -> None:
    """Record one tensor of ``nbytes`` that went ``path`` (``read`` / ``inline`` / ``torch``)."""
    with _LOCK:
        _COUNTS[f"{path}_messages"] += 1
        _COUNTS[f"{path}_bytes"] += nbytes


def effects() -> dict[str, int]:
    """The counters so far (flat, for ``titan_effects``); empty when nothing moved."""
    with _LOCK:
        return dict(_COUNTS)


def reset() -> None:
    """Forget every count (tests)."""
    with _LOCK:
        _COUNTS.clear()
