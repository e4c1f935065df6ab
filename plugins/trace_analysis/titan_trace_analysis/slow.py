"""Slow ranks, nodes, pipeline stages and expert groups, compared work-normalised.

Stages run different layers (the first embeds, the last computes the loss), so raw compute time
cannot be compared across them.  Instead every compute kernel (CPU op in CPU traces) is compared
with the same kernel elsewhere: per kernel name, the reference is the median over ranks of its
mean duration; a rank's slowness is the weighted median, over its kernel names (weight: expected
time), of its mean / reference.  A slow GPU inflates every kernel it runs, whatever it waits for
and whichever stage it serves; a kernel name reused for another shape on one stage moves only
its own share and is outvoted by the median.

A unit (rank, node, stage, expert group) is slow when most of its ranks are (their lower
quartile) at least ``threshold`` times the median of the other units of its kind.  With one
other unit there is no telling which of the two is slow: "insufficient peers", not a verdict.
A rank inside a slow unit is reported only if it is slow relative to that unit too.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from .crossrank import is_partial, stage_of


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    pairs.sort()
    total = sum(w for _, w in pairs)
    acc = 0.0
    for value, w in pairs:
        acc += w
        if acc >= total / 2:
            return value
    return pairs[-1][0]


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def normalised(by_rank: dict[int, dict]) -> dict[int, float]:
    """Per rank: weighted median over kernel names of (its mean duration / the ranks' median)."""
    means: dict[str, list[float]] = {}
    for s in by_rank.values():
        for name, (count, total) in (s.get("names") or {}).items():
            if count > 0:
                means.setdefault(name, []).append(total / count)
    ref = {name: median(v) for name, v in means.items()}
    out = {}
    for r, s in by_rank.items():
        pairs = []
        for name, (count, total) in (s.get("names") or {}).items():
            base = ref.get(name)
            if count > 0 and base and base > 0:
                pairs.append((total / count / base, count * base))
        if pairs:
            out[r] = _weighted_median(pairs)
    return out


def unit_members(
    by_rank: dict[int, dict], ranks_per_node: int = 0
) -> dict[str, dict[Any, list[int]]]:
    """Ranks of every node, stage and expert group (nodes: Kineto's host_name, else
    ``ranks_per_node`` consecutive ranks)."""
    units: dict[str, dict[Any, list[int]]] = {"stage": {}, "node": {}, "expert_group": {}}
    for r, s in sorted(by_rank.items()):
        units["stage"].setdefault(stage_of(s), []).append(r)
        if ranks_per_node > 0:
            units["node"].setdefault(f"ranks {r // ranks_per_node * ranks_per_node}+", []).append(r)
        elif s.get("host"):
            units["node"].setdefault(s["host"], []).append(r)
        if s["coords"].get("ep_size", 1) > 1 and "ep_group" in s["coords"]:
            units["expert_group"].setdefault(s["coords"]["ep_group"], []).append(r)
    return units


def slow_units(
    by_rank: dict[int, dict],
    table: dict[int, dict],
    threshold: float = 1.10,
    ranks_per_node: int = 0,
) -> list[dict[str, Any]]:
    """Slow units, largest first, then ranks not explained by a slow unit; plus "insufficient
    peers" entries where only two units of a kind exist and they differ."""
    norm = normalised(by_rank)
    candidates: list[dict[str, Any]] = []
    same_stage = any(s.get("device") == "cpu" for s in by_rank.values())
    for kind, members in unit_members(by_rank, ranks_per_node).items():
        if same_stage and kind == "stage":
            continue  # stages run different layers; CPU op names cannot normalise that
        vals = {u: [norm[r] for r in rs if r in norm] for u, rs in members.items()}
        vals = {u: v for u, v in vals.items() if v}
        for u, v in vals.items():
            others = [median(w) for o, w in vals.items() if o != u]
            if not others:
                continue
            base = median(others)
            if _quantile(v, 0.25) / base < threshold:
                continue  # not most of its ranks
            candidates.append(
                {
                    "unit": kind,
                    "id": u,
                    "ranks": members[u],
                    "slowdown": median(v) / base,
                    "value": median(v),
                    "peers": len(others),
                    "verdict": "slow" if len(others) >= 2 else "insufficient peers",
                }
            )
    found: list[dict[str, Any]] = []
    seen_sets: dict[frozenset, dict[str, Any]] = {}
    for entry in sorted(candidates, key=lambda e: -len(e["ranks"])):  # largest units first
        key = frozenset(entry["ranks"])
        if key in seen_sets:  # e.g. a node that is exactly one expert group
            seen_sets[key].setdefault("same_as", []).append(
                {"unit": entry["unit"], "id": entry["id"]}
            )
            continue
        home = [e for e in found if e["verdict"] == "slow" and key < frozenset(e["ranks"])]
        if home and entry["value"] / min(e["value"] for e in home) < threshold:
            continue  # an expert group inside a slow stage is slow because the stage is
        seen_sets[key] = entry
        found.append(entry)
    units = [e for e in found if e["verdict"] == "slow"]
    # CPU op names (aten::mm) do not tell shapes apart: only ranks running the same layers
    # (the same stage) are comparable there; GPU kernel names are specific enough for all
    same_stage = any(s.get("device") == "cpu" for s in by_rank.values())
    for r, value in sorted(norm.items()):
        stage = stage_of(by_rank[r])
        others = [
            v
            for o, v in norm.items()
            if o != r and (not same_stage or stage_of(by_rank[o]) == stage)
        ]
        if not others:
            continue
        base = median(others)
        ratio = value / base
        if ratio < threshold:
            continue
        home = [e for e in units if r in e["ranks"]]
        if home and value / min(e["value"] for e in home) < threshold:
            continue  # explained by its slow node / stage / group
        s = by_rank[r]
        found.append(
            {
                "unit": "rank",
                "id": r,
                "ranks": [r],
                "stage": stage_of(s),
                "expert_group": s["coords"].get("ep_group"),
                "slowdown": ratio,
                "compute_us": table.get(r, {}).get("compute_us"),
                "peers": len(others),
                "partial": is_partial(s),
                "verdict": "slow" if len(others) >= 2 else "insufficient peers",
            }
        )
    order = {"stage": 0, "node": 1, "expert_group": 2, "rank": 3}
    return sorted(found, key=lambda e: (e["verdict"] != "slow", order[e["unit"]], -e["slowdown"]))


def slow_ranks(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rank-level verdicts (ranks slow on their own, not as part of a slow unit)."""
    return [
        {k: e[k] for k in ("stage", "expert_group", "slowdown", "compute_us", "peers", "partial")}
        | {"rank": e["id"]}
        for e in units
        if e["unit"] == "rank" and e["verdict"] == "slow"
    ]
