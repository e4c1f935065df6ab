"""Cross-rank critical path of one training step, walked backwards through rank timelines.

From the GPU op that ends the step last (over all ranks), repeatedly ask "what was this rank
waiting for?": a compute run continues back to its start; a compute gap is explained by the
latest communication op that ended in it (else it is host/launch time); a pipeline receive that
started before its matched send jumps to the sender at the send's start (P2P is FIFO per peer
pair, so the n-th send r->p matches the n-th receive at p from r); a collective jumps to the
member that joined it last.  The walk ends at the step start, so the path length is the step's
makespan and every microsecond of it is attributed to compute on a stage, a communication kind,
or host/launch gaps.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from typing import Any

from . import timeline_file
from .kinds import PP_RECV, PP_SEND

EPS = 0.5  # us; Kineto timestamps are 1 us (older) or 1 ns resolution


class StepTimeline:
    """One rank's timeline for one step, indexed for the walk."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.w0, self.w1 = raw["win"]
        flat = raw["comp"]
        self.c0 = flat[0::2]
        self.c1 = flat[1::2]
        ops = sorted(raw["ops"], key=lambda o: o[2])  # [kind, start, end, key, peer, seq]
        self.deps = [o for o in ops if o[0] != PP_SEND]
        self.dep_ends = [o[2] for o in self.deps]
        self.sends = [o for o in ops if o[0] == PP_SEND]
        self.send_ends = [o[2] for o in self.sends]
        self.match: dict[tuple, list] = {}
        for o in ops:
            ident = (o[0], o[4], o[5]) if o[0] in (PP_SEND, PP_RECV) else (o[3], o[5])
            self.match[ident] = o


class Timelines:
    """Lazily loaded rank timelines for one step, with a bounded cache."""

    def __init__(
        self,
        paths: dict[int, str],
        step: str,
        capacity: int = 256,
        latest: dict[tuple, tuple[float, int]] | None = None,
        present: set[int] | None = None,
    ) -> None:
        self.paths, self.step, self.capacity = paths, step, capacity
        self.present = set(paths) if present is None else present  # ranks with this step
        self.latest = latest or {}  # (key, seq) -> (start, rank) of the last member to join
        self.unresolved: set[int] = set()  # peers the path needed but whose trace is absent
        self.cache: OrderedDict[int, StepTimeline | None] = OrderedDict()
        self.keys: dict[str, list[int] | None] = {}

    def get(self, rank: int) -> StepTimeline | None:
        """The timeline of ``rank`` for this step, or None if that rank has none."""
        if rank in self.cache:
            self.cache.move_to_end(rank)
            return self.cache[rank]
        tl = None
        path = self.paths.get(rank)
        if path:
            raw = timeline_file.read_steps(path, [self.step])
            for k, v in raw["keys"].items():
                self.keys.setdefault(k, v)
            if self.step in raw["steps"]:
                tl = StepTimeline(raw["steps"][self.step])
        self.cache[rank] = tl
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return tl


def _latest(ops: list, ends: list[float], lo: float, hi: float):
    i = bisect_right(ends, hi + EPS) - 1
    if i >= 0 and ends[i] > lo - EPS:
        return ops[i]
    return None


def walk(
    tls: Timelines, ends: dict[int, float], stop: float = float("-inf"), max_iter: int = 2_000_000
) -> dict[str, Any]:
    """Critical path of the step whose per-rank window ends are ``ends`` (rank -> end).

    ``stop`` is the end of the previous step's GPU work over all ranks when that step was
    recorded: the step's own time starts there (earlier work on a rank belongs to the previous
    step); otherwise each rank's step starts at its ProfilerStep start.
    """
    r = max(ends, key=lambda x: ends[x])
    t = t_end = ends[r]
    segs: list[list] = []

    def add(rank: int, kind: str, a: float, b: float) -> None:
        if b - a <= 0:
            return
        if segs and segs[-1][0] == rank and segs[-1][1] == kind and abs(segs[-1][2] - b) < EPS:
            segs[-1][2] = a
        else:
            segs.append([rank, kind, a, b])

    for _ in range(max_iter):
        tl = tls.get(r)
        if tl is None or t <= stop + EPS:
            break
        if t <= tl.w0 + EPS:
            if tl.w0 > stop > float("-inf"):  # the rank's CPU began the step after ``stop``
                add(r, "host/launch", stop, t)
                t = stop
            break
        i = bisect_left(tl.c1, t - EPS)
        if i < len(tl.c0) and tl.c0[i] < t - EPS:  # inside a compute run
            a = max(tl.c0[i], tl.w0)
            add(r, "compute", a, t)
            t = a
            continue
        gap_start = tl.c1[i - 1] if i > 0 else tl.w0
        op = _latest(tl.deps, tl.dep_ends, gap_start, t) or _latest(
            tl.sends, tl.send_ends, gap_start, t
        )
        if op is None:
            add(r, "host/launch", gap_start, t)
            t = gap_start
            continue
        end = op[2]
        if end < t:
            add(r, "host/launch", end, t)
            t = end
        r, t = _through(tls, r, t, op, add)
    if t < stop:  # the last segment began in the previous step: this step starts at ``stop``
        if segs and segs[-1][2] < stop:
            segs[-1][2] = stop
        t = stop
    length = t_end - t
    return {
        "length_us": length,
        "end_us": t_end,
        "start_us": t,
        "segments": segs[::-1],
        "unresolved_peers": sorted(tls.unresolved),
    }


def _through(tls: Timelines, r: int, t: float, op: list, add) -> tuple[int, float]:
    """Attribute the communication op ending at ``t`` and return where the walk continues."""
    kind, start, _end, key, peer, seq = op
    if kind == PP_RECV and peer >= 0:
        ptl = tls.get(peer)
        if ptl is None:
            tls.unresolved.add(peer)
        send = ptl.match.get((PP_SEND, r, seq)) if ptl else None
        if send is not None and send[1] > start + EPS and send[1] < t:
            add(r, kind, send[1], t)
            return peer, send[1]
    elif kind != PP_SEND and key:
        tls.get(r)  # make sure the key table is loaded
        hit = tls.latest.get((key, seq))
        known = tls.keys.get(key) or []
        absent = [m for m in known if m != r and m not in tls.present]
        tls.unresolved.update(absent[:16])  # the last to join may be one of them
        members = [] if hit else known
        best_r, best = r, start
        if hit and hit[1] != r and hit[0] > start + EPS and hit[0] < t:
            best, best_r = hit
        for m in members:
            mtl = tls.get(m) if m != r else None
            o = mtl.match.get((key, seq)) if mtl else None
            if o is not None and o[1] > best + EPS and o[1] < t:
                best_r, best = m, o[1]
        if best_r != r:
            add(r, kind, best, t)
            return best_r, best
    a = min(start, t)
    add(r, kind, a, t)
    return r, a


def bound_by(result: dict[str, Any], stage_of: dict[int, int]) -> dict[str, Any]:
    """What bounds the path: time per category and per pipeline stage (compute only)."""
    cats: dict[str, float] = {}
    stages: dict[int, float] = {}
    ranks: dict[int, float] = {}
    for rank, kind, a, b in result["segments"]:
        d = b - a
        cats[kind] = cats.get(kind, 0.0) + d
        ranks[rank] = ranks.get(rank, 0.0) + d
        if kind == "compute":
            s = stage_of.get(rank, 0)
            stages[s] = stages.get(s, 0.0) + d
    total = result["length_us"] or 1.0
    top = sorted(ranks.items(), key=lambda x: -x[1])[:10]
    return {
        "by_kind": {
            k: {"us": v, "share": v / total} for k, v in sorted(cats.items(), key=lambda x: -x[1])
        },
        "compute_by_stage": {str(s): v for s, v in sorted(stages.items())},
        "top_ranks": [{"rank": r, "us": v, "share": v / total} for r, v in top],
    }
