"""Interval arithmetic on sorted, merged lists of ``(start, end)`` pairs (microseconds)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

Interval = tuple[float, float]

try:  # sorted() + union_sorted (+ clip), and overlap, in C where built (tested equal)
    from titan_trace_analysis._native import overlap as _overlap
    from titan_trace_analysis._native import union_any as _any
except ImportError:  # pragma: no cover - built without a C compiler
    _any = _overlap = None


def union(intervals: Iterable[Interval], gap: float = 0.0) -> list[list[float]]:
    """Merge intervals; neighbours closer than ``gap`` are joined into one."""
    if _any is not None:
        pairs = intervals if type(intervals) is list else list(intervals)
        got = _any(pairs, gap)  # sorts by start in C: ties in any order merge the same
        if got is not None:
            return got
        intervals = pairs  # not all pairs of floats, or a NaN: the Python loop decides
    return union_sorted(sorted(intervals), gap)


def union_heads(items: list[tuple], gap: float = 0.0) -> list[list[float]]:
    """:func:`union` of the ``(start, end)`` heads of tuples such as ops (``op[:2]``), without
    building the pairs: the map step unions every op of a rank several times."""
    if _any is not None:
        got = _any(items, gap, True)
        if got is not None:
            return got
    return union([t[:2] for t in items], gap)


def clipped_union_heads(items: list[tuple], lo: float, hi: float) -> list[list[float]]:
    """``clip(union_heads(items), lo, hi)`` in one pass where the extension is built."""
    if _any is not None and type(lo) is float and type(hi) is float:
        got = _any(items, 0.0, True, lo, hi)
        if got is not None:
            return got
    return clip(union_heads(items), lo, hi)


def union_sorted(intervals: Iterable[Interval], gap: float = 0.0) -> list[list[float]]:
    """:func:`union` of intervals already sorted by start."""
    out: list[list[float]] = []
    it = iter(intervals)
    first = next(it, None)
    if first is None:
        return out
    lo, hi = first  # the current run in locals: the hot loop of the map step
    for a, b in it:
        if a <= hi + gap:
            if b > hi:
                hi = b
        else:
            out.append([lo, hi])
            lo, hi = a, b
    out.append([lo, hi])
    return out


def length(merged: list[list[float]]) -> float:
    """Total covered time of a merged list."""
    return sum([b - a for a, b in merged])


def overlap(x: list[list[float]], y: list[list[float]]) -> float:
    """Length of the intersection of two merged lists (linear merge walk)."""
    if _overlap is not None and type(x) is list and type(y) is list:
        got = _overlap(x, y)
        if got is not None:
            return got
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


def subtract(x: list[list[float]], y: list[list[float]]) -> list[list[float]]:
    """The parts of merged list ``x`` not covered by merged list ``y``."""
    out: list[list[float]] = []
    j = 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append([cur, y[k][0]])
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append([cur, b])
    return out


def covers(merged: list[list[float]], a: float, b: float) -> bool:
    """Whether one interval of a merged list contains ``[a, b]``."""
    i = bisect_right(merged, [a, float("inf")]) - 1
    return i >= 0 and merged[i][0] <= a and b <= merged[i][1]
