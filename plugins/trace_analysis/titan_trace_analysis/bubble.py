"""Pipeline bubble of one rank's step: the compute stream's idle time spent waiting on a pipeline
receive.

The compute stream idles in gaps between its ops.  A gap ends when the next op X can start:
after its launch (host time), after the communication it waits for.  The gap is a pipeline
stall when a receive is the last communication to complete in it; the stall runs from the
latest of (gap start, end of any other communication completing in the gap, X's launch, the
receive's launch) to the receive's end.  Idle time while a receive merely happens to be
outstanding (the compute stream waits for an expert all-to-all, the host is late launching X,
the previous step's all-gather is still running) is not bubble.  In CPU traces (gloo) the
training thread itself blocks inside the receive, so the same rule counts the receive's time.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from .kinds import PP_RECV, PP_SEND
from .ops import Op, sort_ops

try:  # the same loop in C where the native extension is built (tested equal)
    from titan_trace_analysis._native import gaps as _native_gaps
except ImportError:  # pragma: no cover - built without a C compiler
    _native_gaps = None

EPS = 5.0  # us: a dependent op starts a few microseconds after what it waited for


Launches = dict[int, tuple[float, int]]


def _end(op: Op) -> float:
    return op[1]


def posted(op: Op, launches: Launches) -> float:
    """When the op was issued: its launch (GPU), its own entry (CPU), or -inf if unknown."""
    if not math.isnan(op.posted):
        return op.posted
    launch = launches.get(op.corr) if op.corr is not None else None
    return launch[0] if launch is not None else -math.inf


def _gaps(
    comp: list[Op], w0: float, w1: float, launches: Launches
) -> list[tuple[float, float, float]]:
    """(gap start, gap end, launch of the op ending it) of the compute stream in [w0, w1]."""
    if _native_gaps is not None:
        got = _native_gaps(comp, w0, w1, launches)
        if got is not None:
            return got
    return _gaps_py(comp, w0, w1, launches)


def _gaps_py(
    comp: list[Op], w0: float, w1: float, launches: Launches
) -> list[tuple[float, float, float]]:
    """:func:`_gaps`'s Python loop (no extension, or ops not as the reader builds them)."""
    out = []
    run_end = w0
    for op in comp:
        start, end = op[0], op[1]  # op.start, op.end: indexing is cheaper in this hot loop
        if start > run_end + 0.5 and start <= w1:
            out.append((run_end, start, posted(op, launches)))
        if end > run_end:  # max(run_end, end)
            run_end = end
    return out


def bubbles(
    compute: list[Op], comm: list[Op], w0: float, w1: float, launches: Launches
) -> list[tuple[float, float]]:
    """The bubble intervals inside the step window [w0, w1], from the step's compute ops and
    communication ops (each list of one class: COMPUTE, COMM)."""
    # op[1] is op.end, op[3] op.kind: indexing is cheaper over a step's ~10k ops
    recvs = sorted([o for o in comm if o[3] == PP_RECV], key=_end)
    if not recvs:
        return []
    comp = sort_ops([o for o in compute if o[1] > w0])
    if not comp:
        return []
    others = sorted([o[1] for o in comm if o[3] not in (PP_RECV, PP_SEND, "")])
    recv_ends = [o.end for o in recvs]
    out = []
    for g0, g1, launch in _gaps(comp, w0, w1, launches):
        i = bisect_right(recv_ends, g1 + EPS) - 1
        if i < 0 or recv_ends[i] <= g0:
            continue
        r = recvs[i]
        j = bisect_right(others, g1 + EPS)
        other_end = others[j - 1] if j and others[j - 1] > g0 else g0
        lo = max(g0, other_end, launch, posted(r, launches))
        if min(r.end, g1) > lo:
            out.append((lo, min(r.end, g1)))
    return out
