"""Cross-rank analyses on per-rank summaries: rank set checks, slow ranks, pipeline bubbles."""

from __future__ import annotations

from statistics import median
from typing import Any


def check_ranks(summaries: list[dict[str, Any]]) -> tuple[dict[int, dict], list[dict]]:
    """Keep one summary per rank; report duplicates, missing ranks and unreadable files.

    Returns (rank -> summary of the analysable ranks, problems as {"file", "problem"}).
    """
    by_rank: dict[int, dict] = {}
    problems: list[dict] = []
    worlds = set()
    for s in sorted(summaries, key=lambda s: s["file"]):
        for p in s["problems"]:
            problems.append({"file": s["file"], "problem": p})
        if s["status"] == "error":
            continue
        r = s.get("rank")
        if r is None:
            continue
        if r in by_rank:
            problems.append(
                {
                    "file": s["file"],
                    "problem": f"duplicate rank {r} (also in {by_rank[r]['file']}): "
                    "this file is ignored; keep one trace per rank in the directory",
                }
            )
            s["status"] = "error"
            continue
        by_rank[r] = s
        if s.get("world_size"):
            worlds.add(int(s["world_size"]))
    if worlds:
        world = max(worlds)
        missing = sorted(set(range(world)) - set(by_rank))
        if missing:
            shown = ", ".join(str(r) for r in missing[:20]) + (" ..." if len(missing) > 20 else "")
            problems.append(
                {
                    "file": "(directory)",
                    "problem": f"missing ranks {shown} of world size {world}: their traces are "
                    "absent or unreadable; the analysis covers the other ranks",
                }
            )
    return by_rank, problems


def common_steps(by_rank: dict[int, dict]) -> list[str]:
    """Step numbers present on every rank that has steps, in order."""
    sets = [set(s["steps"]) for s in by_rank.values() if s.get("steps")]
    if not sets:
        return []
    return sorted(set.intersection(*sets), key=int)


def _stage(s: dict) -> int:
    return int(s["coords"].get("pp", 0))


def per_rank_table(by_rank: dict[int, dict], steps: list[str]) -> dict[int, dict[str, float]]:
    """Per rank, the mean over ``steps`` of every per-step figure (comm kinds flattened)."""
    table: dict[int, dict[str, float]] = {}
    for r, s in by_rank.items():
        rows = [s["steps"][k] for k in steps if k in s.get("steps", {})]
        if not rows:
            continue
        acc: dict[str, float] = {}
        for row in rows:
            for key, val in row.items():
                if isinstance(val, list):
                    continue
                if isinstance(val, dict):
                    for kind, v in val.items():
                        acc["comm." + kind] = acc.get("comm." + kind, 0.0) + v
                else:
                    acc[key] = acc.get(key, 0.0) + val
        table[r] = {k: v / len(rows) for k, v in acc.items()}
        table[r]["bubble_ratio"] = sum(x["bubble_us"] / x["window_us"] for x in rows) / len(rows)
    return table


def slow_ranks(
    by_rank: dict[int, dict], table: dict[int, dict], threshold: float = 1.10
) -> list[dict[str, Any]]:
    """Ranks whose compute time exceeds the median of their peers by ``threshold`` or more.

    Peers are the ranks of the same pipeline stage (same layers); the expert group is reported
    alongside.  Compute time is the sum of compute-kernel time per step, which a straggler
    inflates whatever it waits for, unlike comm-kernel start times (HTA's heuristic).
    """
    stages: dict[int, list[int]] = {}
    for r in table:
        stages.setdefault(_stage(by_rank[r]), []).append(r)
    found = []
    for stage, ranks in sorted(stages.items()):
        if len(ranks) < 2:
            continue
        for r in ranks:
            # median of the *other* ranks, so a slow rank does not dilute its own baseline
            med = median(table[p]["compute_us"] for p in ranks if p != r)
            ratio = table[r]["compute_us"] / med if med else 1.0
            if ratio >= threshold:
                c = by_rank[r]["coords"]
                found.append(
                    {
                        "rank": r,
                        "stage": stage,
                        "expert_group": c.get("ep_group"),
                        "slowdown": ratio,
                        "compute_us": table[r]["compute_us"],
                        "peer_median_us": med,
                        "peers": len(ranks),
                    }
                )
    return sorted(found, key=lambda x: -x["slowdown"])


def bubbles_by_stage(by_rank: dict[int, dict], table: dict[int, dict]) -> list[dict[str, Any]]:
    """Per pipeline stage: mean bubble ratio, bubble time and step window over its ranks."""
    stages: dict[int, list[int]] = {}
    for r in table:
        stages.setdefault(_stage(by_rank[r]), []).append(r)
    out = []
    for stage, ranks in sorted(stages.items()):
        n = len(ranks)
        out.append(
            {
                "stage": stage,
                "ranks": n,
                "bubble_ratio": sum(table[r]["bubble_ratio"] for r in ranks) / n,
                "bubble_us": sum(table[r]["bubble_us"] for r in ranks) / n,
                "window_us": sum(table[r]["window_us"] for r in ranks) / n,
                "compute_idle_ratio": sum(
                    table[r]["compute_idle_us"] / table[r]["window_us"] for r in ranks
                )
                / n,
            }
        )
    return out
