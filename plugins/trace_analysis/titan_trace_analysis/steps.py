"""Per-step figures of one rank from its ops, on device-side step windows.

Ops belong to the step during which the CPU launched them (their launch's correlation id, as
HTA does; CPU-trace ops and ops without a launch by their own start).  A step's window on the
device runs from its first op, or from the end of the rank's previous recorded step when that
is later, to its last op: work the device still does for the previous step (a data-parallel
all-gather the compute stream waits for) is not charged to this step's bubble.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from . import intervals as iv
from .bubble import bubbles
from .kinds import ALL_GATHER, ALL_REDUCE, COMM, COMPUTE, P2P, PP_RECV, PP_SEND, REDUCE_SCATTER
from .ops import Op, sort_ops

try:  # the same loop in C where the native extension is built (tested equal)
    from titan_trace_analysis._native import assign as _native
except ImportError:  # pragma: no cover - built without a C compiler
    _native = None

# Collectives over large groups: their start times travel in the summary so the critical path
# finds the last member to join without loading every member's timeline.
INDEXED = (REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE)

Step = tuple[int, float, float]  # (number, ProfilerStep start, end) on the CPU


def assign(
    steps: list[Step], ops: list[Op], launches: dict[int, tuple[float, int]]
) -> list[list[Op]]:
    """The ops of each step (``steps`` sorted by start)."""
    starts = [s[1] for s in steps]
    ends = [s[2] for s in steps]
    if _native is not None:
        got = _native(starts, ends, ops if type(ops) is list else list(ops), launches)
        if got is not None:
            return got
    return assign_py(starts, ends, ops, launches)


def assign_py(
    starts: list[float], ends: list[float], ops: list[Op], launches: dict[int, tuple[float, int]]
) -> list[list[Op]]:
    """:func:`assign`'s Python loop (no extension, or times that are not floats)."""
    buckets: list[list[Op]] = [[] for _ in starts]
    get = launches.get
    for op in ops:
        corr = op[4]  # op.corr (indexing is cheaper than the named field in this loop)
        launch = get(corr) if corr is not None else None
        t = launch[0] if launch else op[0]
        i = bisect_right(starts, t) - 1
        if i >= 0 and t <= ends[i]:
            buckets[i].append(op)
    return buckets


def per_step(
    steps: list[Step], ops: list[Op], launches: dict[int, tuple[float, int]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures per step, timeline per step) of one rank."""
    stats: dict[str, Any] = {}
    timeline: dict[str, Any] = {}
    prev_num, prev_end = None, float("-inf")
    for (num, _s0, _s1), bucket in zip(steps, assign(steps, ops, launches)):
        if not bucket:
            continue
        start = min([o[0] for o in bucket])  # o.start
        if prev_num is not None and num == prev_num + 1:
            start = max(start, prev_end)
        end = max([o[1] for o in bucket])  # o.end
        if end <= start:
            continue
        stats[str(num)], timeline[str(num)] = one_step(start, end, bucket, launches)
        prev_num, prev_end = num, end
    return stats, timeline


def one_step(
    w0: float, w1: float, ops: list[Op], launches: dict[int, tuple[float, int]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Figures and timeline of one step whose device window is [w0, w1]."""
    compute = [o for o in ops if o[2] == COMPUTE]  # o.klass
    comp = iv.clipped_union_heads(compute, w0, w1)
    comm = [o for o in ops if o[2] == COMM]
    comm_u = iv.clipped_union_heads(comm, w0, w1)
    by_kind: dict[str, float] = {}
    for o in comm:
        if not o.twin:
            by_kind[o.kind] = by_kind.get(o.kind, 0.0) + (o.end - o.start)
    busy = iv.length(comp)
    overlap = iv.overlap(comm_u, comp)
    # unknown when transfers could not be told apart (SendRecv kernels without args or titles)
    bubble = (
        None if any(o.kind == P2P for o in comm) else bubbles(compute, comm, w0, w1, launches or {})
    )
    stat: dict[str, Any] = {
        "win": [w0, w1],
        "window_us": w1 - w0,
        "compute_us": sum([o[1] - o[0] for o in compute]),
        "compute_busy_us": busy,
        "compute_idle_us": (w1 - w0) - busy,
        "comm_us": by_kind,
        "comm_busy_us": iv.length(comm_u),
        "overlap_us": overlap,
        "exposed_comm_us": iv.length(comm_u) - overlap,
        "memory_us": sum([o[1] - o[0] for o in ops if o[2] != COMPUTE and o[2] != COMM]),
        # compute stream waiting on a pipeline receive (see bubble.py)
        "bubble_us": None if bubble is None else sum(b - a for a, b in bubble),
    }
    seq: dict[tuple, int] = {}
    tl_ops = []
    stat["dp_coll"] = dp_coll = []
    for o in sort_ops(comm):
        ident = (o.kind, o.peer) if o.kind in (PP_SEND, PP_RECV) else (o.key,)
        n = seq.get(ident, 0)
        seq[ident] = n + 1
        tl_ops.append([o.kind, o.start, o.end, o.key, o.peer, n])
        if o.kind in INDEXED:
            dp_coll.append([o.key, n, o.start])
    flat = [x for ab in comp for x in ab]
    bub = [x for ab in bubble or () for x in ab]
    return stat, {"win": [w0, w1], "comp": flat, "ops": tl_ops, "bub": bub}


def temporal(ops: list[Op]) -> dict[str, float]:
    """HTA's temporal breakdown of a set of ops: idle / compute / non-compute over their span."""
    if not ops:
        return {"span_us": 0.0, "idle_us": 0.0, "compute_us": 0.0, "non_compute_us": 0.0}
    every = iv.union_heads(ops)  # (start, end)
    span = every[-1][1] - every[0][0]
    idle = span - iv.length(every)
    compute = iv.length(iv.union_heads([o for o in ops if o[2] == COMPUTE]))  # o.klass
    return {
        "span_us": span,
        "idle_us": idle,
        "compute_us": compute,
        "non_compute_us": span - compute - idle,
    }


def hta_window(
    ops: list[Op], steps: list[Step], launches: dict[int, tuple[float, int]]
) -> list[Op]:
    """The ops HTA 0.5.0 keeps by default: those launched before the last ProfilerStep began
    (ops without a launch event are dropped); all ops when there are fewer than two steps."""
    if len(steps) < 2:
        return ops
    last = max(s[1] for s in steps)
    out = []
    for o in ops:
        launch = launches.get(o.corr) if o.corr is not None else None
        if launch is not None and launch[0] < last:
            out.append(o)
    return out
