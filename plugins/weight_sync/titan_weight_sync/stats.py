"""What weight_sync did in this process (counted, for ``titan_effects``)."""

from __future__ import annotations

from collections import Counter

COUNTS: Counter[str] = Counter()
"""engine: hellos, commits, tensors_loaded, bytes_loaded, refused_<reason>; trainer: syncs,
bytes_written, tensors_written, engines_synced, fallbacks."""


def count(key: str, amount: int = 1) -> None:
    """Add ``amount`` to the counter ``key``."""
    COUNTS[key] += amount


def snapshot() -> dict[str, int]:
    """The counters now (a copy)."""
    return dict(COUNTS)
