"""Cross-rank bookkeeping on per-rank summaries: the rank set, the steps, per-stage bubbles."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .safe import safe_text


def check_ranks(summaries: list[dict[str, Any]]) -> tuple[dict[int, dict], list[dict], int | None]:
    """Keep one summary per rank; report duplicates, world-size disagreements, missing ranks.

    Returns (rank -> summary of the analysable ranks, problems as {"file", "problem"}, world
    size agreed by most files).
    """
    by_rank: dict[int, dict] = {}
    problems: list[dict] = []
    for s in sorted(summaries, key=lambda s: s["file"]):
        for p in s["problems"]:
            problems.append({"file": s["file"], "problem": p})
        if s["status"] == "error" or s.get("rank") is None:
            continue
        r = s["rank"]
        if r in by_rank:
            problems.append(
                {
                    "file": s["file"],
                    "problem": f"duplicate rank {r} (also in {safe_text(by_rank[r]['file'])}): "
                    "this file is ignored; keep one trace per rank in the directory",
                }
            )
            s["status"] = "error"
            continue
        by_rank[r] = s
    worlds = Counter(s["world_size"] for s in by_rank.values() if s.get("world_size"))
    world = worlds.most_common(1)[0][0] if worlds else None
    if len(worlds) > 1:
        odd = sorted(r for r, s in by_rank.items() if s.get("world_size") not in (None, world))
        problems.append(
            {
                "file": "(directory)",
                "problem": f"files disagree on world_size ({dict(worlds)}): {world} used; ranks "
                f"{_short(odd)} say otherwise (traces of different jobs mixed?)",
            }
        )
    for key in ("pp_size", "ep_size", "dp_size", "tp_size"):
        sizes = Counter(s["coords"][key] for s in by_rank.values() if key in s["coords"])
        if len(sizes) > 1:
            common = sizes.most_common(1)[0][0]
            odd = sorted(r for r, s in by_rank.items() if s["coords"].get(key, common) != common)
            problems.append(
                {
                    "file": "(directory)",
                    "problem": f"files disagree on {key} ({dict(sizes)}): ranks {_short(odd)} "
                    f"differ from the {common} most files say (traces of different jobs mixed?)",
                }
            )
    if world:
        beyond = sorted(r for r in by_rank if r >= world)
        for r in beyond:
            problems.append(
                {"file": by_rank[r]["file"], "problem": f"rank {r} >= world_size {world}; ignored"}
            )
            del by_rank[r]
        missing = missing_ranks(by_rank, world)
        if missing:
            problems.append(
                {
                    "file": "(directory)",
                    "problem": f"missing ranks {_short(missing)} of world size {world}: their "
                    "traces are absent or unreadable; the analysis covers the other ranks",
                }
            )
    return by_rank, problems, world


def missing_ranks(by_rank: dict[int, dict], world: int) -> list[int]:
    """Ranks below ``world`` without an analysable trace (world is validated <= 1,000,000)."""
    return [r for r in range(world) if r not in by_rank]


def _short(ranks: list[int], limit: int = 20) -> str:
    return ", ".join(str(r) for r in ranks[:limit]) + (" ..." if len(ranks) > limit else "")


def is_partial(s: dict[str, Any]) -> bool:
    """Whether a rank's trace was salvaged from a truncated or damaged file."""
    return bool(s.get("truncated"))


def common_steps(by_rank: dict[int, dict]) -> list[str]:
    """Steps present on every complete rank that has steps (partial ranks join where they can)."""
    complete = [set(s["steps"]) for s in by_rank.values() if s.get("steps") and not is_partial(s)]
    sets = complete or [set(s["steps"]) for s in by_rank.values() if s.get("steps")]
    if not sets:
        return []
    return sorted(set.intersection(*sets), key=int)


def stage_of(s: dict[str, Any]) -> int:
    """Pipeline stage of a rank (0 when the job has no pipeline parallelism)."""
    return int(s["coords"].get("pp", 0))


def stages_of_all(by_rank: dict[int, dict], world: int | None) -> dict[int, int]:
    """Stage of every rank, missing ones included where a peer's pipeline group names them."""
    out = {r: stage_of(s) for r, s in by_rank.items()}
    for s in by_rank.values():
        group = s.get("groups", {}).get("pp")
        if group:
            for i, r in enumerate(group):
                out.setdefault(r, i)
    if world:
        out = {r: v for r, v in out.items() if r < world}
    return out


def per_rank_table(by_rank: dict[int, dict], steps: list[str]) -> dict[int, dict[str, float]]:
    """Per rank, the mean over ``steps`` of every per-step figure (comm kinds flattened); a
    figure unknown (None) in any of its steps is left out, never averaged as if measured."""
    table: dict[int, dict[str, float]] = {}
    for r, s in by_rank.items():
        rows = [s["steps"][k] for k in steps if k in s.get("steps", {})]
        if not rows:
            continue
        acc: dict[str, float] = {}
        unknown: set[str] = set()
        for row in rows:
            for key, val in row.items():
                if isinstance(val, list):
                    continue
                if val is None:
                    unknown.add(key)
                    continue
                if isinstance(val, dict):
                    for kind, v in val.items():
                        acc["comm." + kind] = acc.get("comm." + kind, 0.0) + v
                else:
                    acc[key] = acc.get(key, 0.0) + val
        table[r] = {k: v / len(rows) for k, v in acc.items() if k not in unknown}
        if "bubble_us" not in unknown:
            table[r]["bubble_ratio"] = sum(x["bubble_us"] / x["window_us"] for x in rows) / len(
                rows
            )
    return table


def bubbles_by_stage(by_rank: dict[int, dict], table: dict[int, dict]) -> list[dict[str, Any]]:
    """Per pipeline stage: mean bubble ratio, bubble time and step window over its ranks
    (``None`` where the bubble cannot be measured: transfers without args or titles, or ranks
    whose compute was not measured; ``not_measured`` then says why)."""
    stages: dict[int, list[int]] = {}
    for r in table:
        stages.setdefault(stage_of(by_rank[r]), []).append(r)
    out = []
    for stage, ranks in sorted(stages.items()):
        known = [r for r in ranks if "bubble_ratio" in table[r]]
        idle = [r for r in ranks if "compute_idle_us" in table[r]]
        lost = [r for r in ranks if by_rank[r].get("compute_not_measured")]
        n = len(ranks)
        entry = {
            "stage": stage,
            "ranks": n,
            "bubble_ratio": _mean([table[r]["bubble_ratio"] for r in known]),
            "bubble_us": _mean([table[r]["bubble_us"] for r in known]),
            "window_us": sum(table[r]["window_us"] for r in ranks) / n,
            "compute_idle_ratio": _mean(
                [table[r]["compute_idle_us"] / table[r]["window_us"] for r in idle]
            ),
        }
        if lost:
            many = len(lost) > 1
            entry["not_measured"] = (
                f"the compute events of rank{'s' if many else ''} {_short(lost)} were dropped"
                + ("; the figures are over the other ranks" if known else "")
            )
        elif not known:
            entry["not_measured"] = "transfers not told apart (P2P pairing impossible)"
        out.append(entry)
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
