"""One Chrome-trace JSON of the analysed job (Perfetto and chrome://tracing open it).

The step on which the critical path is longest, for the ranks on that path plus others up to a
limit: one process per rank ("rank R, stage S"), threads for compute, each communication kind,
the pipeline bubbles and the critical path; the path's segments are linked by flow events (arrows
from each segment to the next, across ranks).  Times are microseconds from the step's start.
The analysis warnings travel in ``otherData``.
"""

from __future__ import annotations

import json
from typing import Any

from .fastpath import loads
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


def build(report: dict[str, Any], max_ranks: int = 64) -> dict[str, Any]:
    """The merged trace as a dict (``write`` dumps it)."""
    cp = report["critical_path"]
    step = cp.get("detail_step")
    timelines = report.get("_timelines", {})
    events: list[dict[str, Any]] = []
    other = {"generator": "titan-trace", "step": step, "warnings": report.get("warnings", [])}
    if step is None:
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    t0 = cp["steps"][step]["start_us"]
    stage = {int(r): v for r, v in report.get("stage_of", {}).items()}

    def x(pid: int, tid: int, name: str, a: float, b: float, args: dict | None = None) -> None:
        ev = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": a - t0, "dur": b - a}
        if args:
            ev["args"] = args
        events.append(ev)

    for r in _ranks(report, max_ranks):
        meta = {"ph": "M", "pid": r, "tid": 0}
        label = f"rank {r}, stage {stage.get(r, '?')}"
        events.append({**meta, "name": "process_name", "args": {"name": label}})
        events.append({**meta, "name": "process_sort_index", "args": {"sort_index": r}})
        for tid, name in [(TID_COMPUTE, "compute"), (TID_BUBBLE, "pipeline bubble"),
                          (TID_PATH, "critical path")] + [(t, k) for k, t in TID_COMM.items()]:  # fmt: skip
            events.append({"ph": "M", "pid": r, "tid": tid, "name": "thread_name",
                           "args": {"name": name}})  # fmt: skip
        path = timelines.get(r) or timelines.get(str(r))
        if not path:
            continue
        with open(path, "rb") as fh:
            tl = loads(fh.read())["steps"].get(step)
        if not tl:
            continue
        comp, bub = tl["comp"], tl.get("bub", [])
        for i in range(0, len(comp), 2):
            x(r, TID_COMPUTE, "compute", comp[i], comp[i + 1])
        for i in range(0, len(bub), 2):
            x(r, TID_BUBBLE, "bubble", bub[i], bub[i + 1])
        by_kind: dict[str, list] = {}
        for op in tl["ops"]:
            by_kind.setdefault(op[0], []).append(op)
        for kind, ops in by_kind.items():
            for tid, (k, a, b, key, peer, seq) in _lanes(ops, TID_COMM.get(kind, 80)):
                x(r, tid, k, a, b, {"peer": peer, "group": key, "seq": seq})
    shown = set(_ranks(report, max_ranks))
    segs = [s for s in cp["segments"] if s[0] in shown]
    for i, (r, kind, a, b) in enumerate(segs):
        x(r, TID_PATH, kind, a, b, {"critical path segment": i})
        if i + 1 < len(segs):
            r2, _k2, a2, b2 = segs[i + 1]
            mid1, mid2 = a + (b - a) / 2, a2 + (b2 - a2) / 2
            flow = {"cat": "critical_path", "name": "critical path", "id": i}
            events.append({**flow, "ph": "s", "pid": r, "tid": TID_PATH, "ts": mid1 - t0})
            events.append({**flow, "ph": "f", "bp": "e", "pid": r2, "tid": TID_PATH,
                           "ts": mid2 - t0})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write(report: dict[str, Any], path: str, max_ranks: int = 64) -> None:
    """Write the merged trace of ``report`` to ``path``."""
    with open(path, "w") as fh:
        json.dump(finite(build(report, max_ranks)), fh, allow_nan=False, separators=(",", ":"))
