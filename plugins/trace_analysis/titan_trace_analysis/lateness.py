"""Lateness of ranks whose trace is missing or partial, inferred from their peers' waits.

A collective cannot finish before its last member joins, and a pipeline receive cannot finish
before its sender sends: when rank X is absent from a step, the peers that communicated with X
show how long they waited for it.  Per collective instance involving X, X's lateness is how long
even the last present member waited beyond the transfer itself (its duration minus the shortest
duration of that kind anywhere); per receive from X, the receive's duration minus the shortest
receive.  Summed per step, this is an estimate, and is reported as one.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

from .fastpath import loads
from .kinds import PP_RECV, PP_SEND

MAX_PEERS = 64


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            return loads(fh.read())
    except (OSError, ValueError):
        return None


def infer(
    absent: dict[int, list[str]], by_rank: dict[int, dict], share_threshold: float = 0.05
) -> list[dict[str, Any]]:
    """For each absent rank (rank -> steps it lacks): its inferred lateness per step."""
    out = []
    for x, steps in sorted(absent.items()):
        if not steps:
            continue
        peers = sorted(
            r
            for r, s in by_rank.items()
            if r != x and s.get("timeline") and any(x in g for g in s.get("groups", {}).values())
        )[:MAX_PEERS]
        timelines = {p: tl for p in peers if (tl := _load(by_rank[p]["timeline"]))}
        keys: dict[str, list[int] | None] = {}
        for tl in timelines.values():
            for k, v in tl.get("keys", {}).items():
                keys.setdefault(k, v)
        per_step, instances = [], 0
        for k in steps:
            late, n = _step_lateness(x, k, timelines, keys)
            if n:
                per_step.append(late)
                instances += n
        if not per_step:
            out.append({"rank": x, "steps": steps, "late_us": None, "evidence": 0,
                        "verdict": "no peer communicated with it in the traces present"})  # fmt: skip
            continue
        windows = [
            by_rank[p]["steps"][k]["window_us"]
            for p in timelines
            for k in steps
            if k in by_rank[p].get("steps", {})
        ]
        late = mean(per_step)
        share = late / mean(windows) if windows else 0.0
        out.append(
            {
                "rank": x,
                "steps": steps,
                "late_us": late,
                "share_of_step": share,
                "evidence": instances,
                "peers": len(timelines),
                "verdict": "likely slow (inferred from its peers' waits)"
                if share >= share_threshold
                else "no sign of lateness in its peers' waits",
            }
        )
    return out


def _step_lateness(
    x: int, step: str, timelines: dict[int, dict], keys: dict[str, list[int] | None]
) -> tuple[float, int]:
    base: dict[str, float] = {}
    groups: dict[tuple[str, int], tuple[str, list[float]]] = {}
    recv_waits: list[float] = []
    for tl in timelines.values():
        for kind, start, end, key, peer, seq in tl.get("steps", {}).get(step, {}).get("ops", ()):
            dur = end - start
            if kind == PP_SEND:
                continue
            base[kind] = min(base.get(kind, dur), dur)
            if kind == PP_RECV:
                if peer == x:
                    recv_waits.append(dur)
            elif x in (keys.get(key) or ()):
                groups.setdefault((key, seq), (kind, []))[1].append(dur)
    late = sum(max(0.0, d - base.get(PP_RECV, d)) for d in recv_waits)
    for kind, durs in groups.values():
        late += max(0.0, min(durs) - base[kind])
    return late, len(recv_waits) + len(groups)
