"""One Chrome-trace JSON of the analysed job (Perfetto and chrome://tracing open it).

The step on which the critical path is longest, for the ranks on that path plus others up to a
limit: one process per rank ("rank R, stage S"), threads for compute, each communication kind,
the pipeline bubbles and the critical path; the path's segments are linked by flow events (arrows
from each segment to the next, across ranks).  Times are microseconds from the step's start.
The analysis warnings travel in ``otherData``.
"""

from __future__ import annotations

import json
from itertools import chain
from typing import Any

from . import timeline_file
from .fastpath import dumps
from .kinds import COMM_KINDS
from .safe import finite

TID_COMPUTE, TID_BUBBLE, TID_PATH = 1, 90, 99
TID_COMM = {kind: 10 + 4 * i for i, kind in enumerate(COMM_KINDS)}  # 4 lanes per kind


def _ranks(report: dict[str, Any], limit: int) -> list[int]:
    on_path = list(dict.fromkeys(s[0] for s in report["critical_path"]["segments"]))
    rest = [int(r) for r in report["ranks"] if int(r) not in on_path]
    return sorted(set(on_path[:limit] + rest[: max(0, limit - len(on_path))]))


def _lanes(ops: list[list], base: int) -> list[tuple[int, list]]:
    """Overlapping ops of one kind on separate lanes (slices on one thread must nest)."""
    ends: list[float] = []
    out = []
    for op in sorted(ops, key=lambda o: o[1]):
        lane = next((i for i, e in enumerate(ends) if e <= op[1]), None)
        if lane is None:
            lane = len(ends)
            ends.append(op[2])
        ends[lane] = op[2]
        out.append((base + min(lane, 3), op))
    return out


def _rank_events(r: int, path: str | None, step: str, t0: float, stage: dict) -> list[dict]:
    """Metadata, compute, bubble and communication slices of one rank in ``step``."""
    meta = {"ph": "M", "pid": r, "tid": 0}
    events: list[dict[str, Any]] = [
        {**meta, "name": "process_name", "args": {"name": f"rank {r}, stage {stage.get(r, '?')}"}},
        {**meta, "name": "process_sort_index", "args": {"sort_index": r}},
    ]
    threads = [
        (TID_COMPUTE, "compute"),
        (TID_BUBBLE, "pipeline bubble"),
        (TID_PATH, "critical path"),
    ]
    for tid, name in threads + [(t, k) for k, t in TID_COMM.items()]:
        events.append(
            {"ph": "M", "pid": r, "tid": tid, "name": "thread_name", "args": {"name": name}}
        )
    if not path:
        return events
    tl = timeline_file.read_step(path, step)
    if not tl:
        return events

    # one "X" slice per compute run, bubble and op; built in comprehensions (a rank's step
    # has ~5k compute runs: a helper call per slice was most of this function's time)
    comp, bub = tl["comp"], tl.get("bub", [])
    for tid, name, flat in ((TID_COMPUTE, "compute", comp), (TID_BUBBLE, "bubble", bub)):
        events += [
            {"ph": "X", "pid": r, "tid": tid, "name": name, "ts": a - t0, "dur": b - a}
            for a, b in zip(flat[0::2], flat[1::2])
        ]
    by_kind: dict[str, list] = {}
    for op in tl["ops"]:
        by_kind.setdefault(op[0], []).append(op)
    for kind, ops in by_kind.items():
        events += [
            {
                "ph": "X",
                "pid": r,
                "tid": tid,
                "name": k,
                "ts": a - t0,
                "dur": b - a,
                "args": {"peer": peer, "group": key, "seq": seq},
            }
            for tid, (k, a, b, key, peer, seq) in _lanes(ops, TID_COMM.get(kind, 80))
        ]
    return events


def _path_events(report: dict[str, Any], shown: set[int], t0: float) -> list[dict]:
    """The critical path: one slice per segment, a flow from each segment to the next."""
    segs = [s for s in report["critical_path"]["segments"] if s[0] in shown]
    events: list[dict[str, Any]] = []
    for i, (r, kind, a, b) in enumerate(segs):
        events.append({"ph": "X", "pid": r, "tid": TID_PATH, "name": kind, "ts": a - t0,
                       "dur": b - a, "args": {"critical path segment": i}})  # fmt: skip
        if i + 1 < len(segs):
            r2, _k2, a2, b2 = segs[i + 1]
            flow = {"cat": "critical_path", "name": "critical path", "id": i}
            events.append(
                {**flow, "ph": "s", "pid": r, "tid": TID_PATH, "ts": a + (b - a) / 2 - t0}
            )
            events.append({**flow, "ph": "f", "bp": "e", "pid": r2, "tid": TID_PATH,
                           "ts": a2 + (b2 - a2) / 2 - t0})  # fmt: skip
    return events


def write(report: dict[str, Any], path: str, max_ranks: int = 64) -> None:
    """Write the merged trace of ``report`` to ``path``, one rank at a time (memory: one rank)."""
    cp = report["critical_path"]
    step = cp.get("detail_step")
    other = {"generator": "titan-trace", "step": step, "warnings": report.get("warnings", [])}
    timelines = report.get("_timelines", {})
    stage = {int(r): v for r, v in report.get("stage_of", {}).items()}
    with open(path, "wb") as fh:
        fh.write(b'{"displayTimeUnit": "ms", "otherData": ')
        fh.write(json.dumps(finite(other), allow_nan=False).encode())
        fh.write(b', "traceEvents": [')
        sep = b""
        if step is not None:
            t0 = cp["steps"][step]["start_us"]
            ranks = _ranks(report, max_ranks)
            groups = (
                _rank_events(r, timelines.get(r) or timelines.get(str(r)), step, t0, stage)
                for r in ranks
            )
            for events in chain(groups, [_path_events(report, set(ranks), t0)]):
                if events:  # one rank's events at a time
                    fh.write(sep + dumps(events)[1:-1])  # times are finite by construction
                    sep = b","
        fh.write(b"]}")
