"""The default host budget of rewind's snapshots: a leaf.

Its own module (standard library only) because the snapshot store, the state machine's
description before the first step (:mod:`titan_rewind.loop`) and the doctor checks all use the
same rule, and the doctor reads the state machine back: kept in :mod:`titan_rewind.doctor`, the
rule closed an import circle through it.
"""

from __future__ import annotations

import os

HOST_FRACTION = 0.25  # default budget: this share of physical RAM, split over local ranks


def physical_memory() -> int | None:
    """Bytes of RAM, or None where unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_budget() -> int:
    """25% of physical memory divided by the local world size (``LOCAL_WORLD_SIZE``)."""
    total = physical_memory() or 64 << 30
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(total * HOST_FRACTION) // local
