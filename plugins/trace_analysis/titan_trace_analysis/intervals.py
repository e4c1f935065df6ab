"""Interval arithmetic on sorted, merged lists of ``(start, end)`` pairs (microseconds)."""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval], gap: float = 0.0) -> list[list[float]]:
    """Merge intervals; neighbours closer than ``gap`` are joined into one."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + gap:
            if b > out[-1][1]:
                out[-1][1] = b
        else:
            out.append([a, b])
    return out


def length(merged: list[list[float]]) -> float:
    """Total covered time of a merged list."""
    return sum(b - a for a, b in merged)


def overlap(x: list[list[float]], y: list[list[float]]) -> float:
    """Length of the intersection of two merged lists (linear merge walk)."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo = x[i][0] if x[i][0] > y[j][0] else y[j][0]
        hi = x[i][1] if x[i][1] < y[j][1] else y[j][1]
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(merged: list[list[float]], lo: float, hi: float) -> list[list[float]]:
    """The part of a merged list inside ``[lo, hi]``."""
    return [[max(a, lo), min(b, hi)] for a, b in merged if b > lo and a < hi]
