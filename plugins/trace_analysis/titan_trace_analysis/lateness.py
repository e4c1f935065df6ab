"""Lateness of ranks whose trace is missing or partial, inferred from their peers' waits.

A collective cannot finish before its last member joins: when rank X is absent from a step, even
the last of its present group members to join still waited for X.  Per collective instance of
X's groups, that member's wait (the shortest duration among the present members) minus the
typical wait of the last member in complete groups of the same kind (instances where every
member is present) estimates how late X was; summed over the step's instances, it is X's
lateness per step.  Pipeline receives are not used: a stage waits for its neighbour in any
healthy pipeline (that is the bubble), so a receive's length says little about the sender.
The result is an estimate and is reported as one.
"""

from __future__ import annotations

from statistics import mean, median
from typing import Any

from . import timeline_file
from .kinds import PP_RECV, PP_SEND

MAX_PEERS = 64
MAX_REFERENCE = 16  # ranks outside X's groups loaded to learn the typical last-member wait


def _load(path: str, steps: list[str]) -> dict[str, Any] | None:
    """The group keys and, for ``steps`` only, the communication ops of one timeline."""
    try:
        tl = timeline_file.read_steps(path, steps)
    except (OSError, ValueError):
        return None
    kept = {k: {"ops": v["ops"]} for k, v in tl["steps"].items()}
    return {"keys": tl["keys"], "steps": kept}


def infer(
    absent: dict[int, list[str]], by_rank: dict[int, dict], share_threshold: float = 0.05
) -> list[dict[str, Any]]:
    """For each absent rank (rank -> steps it lacks): its inferred lateness per step."""
    out = []
    with_tl = sorted(r for r, s in by_rank.items() if s.get("timeline"))
    for x, steps in sorted(absent.items()):
        if not steps:
            continue
        peers = [r for r in with_tl if r != x and _shares_group(by_rank[r], x)][:MAX_PEERS]
        others = [r for r in with_tl if r != x and r not in peers][:MAX_REFERENCE]
        timelines = {p: tl for p in peers + others if (tl := _load(by_rank[p]["timeline"], steps))}
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
        entry: dict[str, Any] = {"rank": x, "steps": steps, "evidence": instances}
        if not per_step:
            entry.update(late_us=None, verdict="no collective of its groups in the traces present")
            out.append(entry)
            continue
        windows = [
            by_rank[p]["steps"][k]["window_us"]
            for p in peers
            for k in steps
            if k in by_rank[p].get("steps", {})
        ]
        late = mean(per_step)
        share = late / mean(windows) if windows else 0.0
        entry.update(late_us=late, share_of_step=share, peers=len(peers))
        entry["verdict"] = (
            "likely slow (inferred from its peers' waits)"
            if share >= share_threshold
            else "no sign of lateness in its peers' waits"
        )
        out.append(entry)
    return out


def _shares_group(summary: dict[str, Any], x: int) -> bool:
    return any(x in g for g in summary.get("groups", {}).values())


def _step_lateness(
    x: int, step: str, timelines: dict[int, dict], keys: dict[str, list[int] | None]
) -> tuple[float, int]:
    """(X's estimated lateness in ``step``, collective instances of X's groups seen)."""
    present = {r for r, tl in timelines.items() if step in tl.get("steps", {})}
    instances: dict[tuple[str, int], tuple[str, list[float]]] = {}
    for tl in timelines.values():
        for kind, start, end, key, _peer, seq in tl.get("steps", {}).get(step, {}).get("ops", ()):
            if kind in (PP_SEND, PP_RECV) or not keys.get(key):
                continue
            instances.setdefault((key, seq), (kind, []))[1].append(end - start)
    typical: dict[str, list[float]] = {}
    mine: list[tuple[str, float]] = []
    for (key, _seq), (kind, durs) in instances.items():
        members = keys.get(key) or []
        if x in members:
            mine.append((kind, min(durs)))
        elif all(m in present for m in members):
            typical.setdefault(kind, []).append(min(durs))
    late, n = 0.0, 0
    for kind, wait in mine:
        if kind in typical:
            late += max(0.0, wait - median(typical[kind]))
            n += 1
    return late, n
