"""Orchestration: find traces, run the map step, then the cross-rank analyses on summaries."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from . import critical_path as cp
from . import lateness
from .crossrank import (
    bubbles_by_stage,
    check_ranks,
    common_steps,
    is_partial,
    missing_ranks,
    per_rank_table,
    stage_of,
    stages_of_all,
)
from .discover import find_traces
from .engine import run_map
from .slow import slow_ranks, slow_units
from .summarize import Options
from .warnings import collect_warnings


@dataclass(frozen=True)
class Settings:
    """Analysis options (the command line's flags)."""

    engine: str = "local"
    workers: int = 0
    progress: bool | None = None
    slow_threshold: float = 1.10
    ray_address: str | None = None
    keep_timelines: bool = False
    ranks_per_node: int = 0
    map: Options = Options()


def analyze(trace_dir: str, out_dir: str, settings: Settings | None = None, **kw: Any) -> dict:
    """Analyse every trace in ``trace_dir``; returns the report (also the JSON output).

    Keyword arguments override fields of ``settings`` (e.g. ``workers=2``).
    """
    st = settings or Settings()
    if kw:
        fields = {k: v for k, v in kw.items() if k in Settings.__dataclass_fields__}
        st = Settings(**{**st.__dict__, **fields})
    t0 = time.monotonic()
    paths, problems = find_traces(trace_dir)
    skipped = len(problems)
    tl_dir = os.path.join(out_dir, "timelines")
    os.makedirs(tl_dir, exist_ok=True)
    summaries = run_map(
        paths, tl_dir, st.engine, st.workers, st.progress, st.ray_address, options=st.map
    )
    t_map = time.monotonic() - t0
    by_rank, rank_problems, world = check_ranks(summaries)
    problems += rank_problems
    steps = common_steps(by_rank)
    table = per_rank_table(by_rank, steps)
    units = slow_units(by_rank, table, st.slow_threshold, st.ranks_per_node)
    absent = {r: steps for r in (missing_ranks(by_rank, world) if world else [])}
    absent.update(
        {r: [k for k in steps if k not in s["steps"]] for r, s in by_rank.items() if is_partial(s)}
    )
    report: dict[str, Any] = {
        "trace_dir": os.path.abspath(trace_dir),
        "files": len(paths) + skipped,
        "ranks_analyzed": len(by_rank),
        "world_size": world,
        "events": sum(s.get("events", 0) for s in summaries),
        "steps": steps,
        "window": st.map.window,
        "problems": problems,
        "ranks": {
            str(r): {
                "file": s["file"],
                "coords": s["coords"],
                "host": s.get("host"),
                "device": s.get("device"),
                "partial": is_partial(s),
                "temporal": s.get("temporal_hta" if st.map.window == "hta" else "temporal"),
                "mean_per_step": table.get(r),
                **{k: s[k] for k in ("dropped", "compute_not_measured") if k in s},
            }
            for r, s in sorted(by_rank.items())
        },
        "stage_of": {str(r): v for r, v in sorted(stages_of_all(by_rank, world).items())},
        "stages": bubbles_by_stage(by_rank, table),
        "slow_units": units,
        "slow_ranks": slow_ranks(units),
        "lateness": lateness.infer({r: k for r, k in absent.items() if k}, by_rank),
        "critical_path": _critical_paths(by_rank, steps),
    }
    report["warnings"] = collect_warnings(summaries, report)
    report["partial"] = bool(problems) or any(s.get("truncated") for s in summaries)
    report["seconds"] = {"map": t_map, "total": time.monotonic() - t0}
    if not paths:
        report["problems"].append({"file": trace_dir, "problem": "no *.json / *.json.gz traces"})
        report["partial"] = True
    report["_timelines"] = {r: s["timeline"] for r, s in by_rank.items() if s.get("timeline")}
    if not st.keep_timelines:
        report["_cleanup"] = tl_dir
    return report


def finish(report: dict[str, Any]) -> None:
    """Remove the per-rank timelines once every output that needs them is written."""
    tl_dir = report.pop("_cleanup", None)
    report.pop("_timelines", None)
    if tl_dir:
        shutil.rmtree(tl_dir, ignore_errors=True)


def _critical_paths(by_rank: dict[int, dict], steps: list[str]) -> dict[str, Any]:
    # a rank without a timeline (its compute was not measured) is as absent as a missing one:
    # the walk reports it as a rank it needed instead of reading its compute as idle time
    by_rank = {r: s for r, s in by_rank.items() if s.get("timeline")}
    paths = {r: s["timeline"] for r, s in by_rank.items()}
    stage = {r: stage_of(s) for r, s in by_rank.items()}
    out: dict[str, Any] = {"steps": {}, "detail_step": None, "segments": []}
    longest = -1.0
    prev_end: dict[int, float] = {}
    for k in steps:
        ends = {r: s["steps"][k]["win"][1] for r, s in by_rank.items() if k in s["steps"]}
        if not ends:
            continue
        # the previous iteration bounds this one only if it was recorded (consecutive numbers)
        stop = max(prev_end.values()) if str(int(k) - 1) in out["steps"] else float("-inf")
        prev_end = ends
        latest: dict[tuple, tuple[float, int]] = {}
        for r, s in by_rank.items():
            for key, seq, start in s["steps"].get(k, {}).get("dp_coll", ()):
                if start > latest.get((key, seq), (float("-inf"), r))[0]:
                    latest[(key, seq)] = (start, r)
        tls = cp.Timelines(paths, k, latest=latest, present=set(ends))
        res = cp.walk(tls, ends, stop)
        out["steps"][k] = {
            "length_us": res["length_us"],
            "start_us": res["start_us"],
            "end_us": res["end_us"],
            "unresolved_peers": res["unresolved_peers"],
            **cp.bound_by(res, stage),
        }
        if res["length_us"] > longest:
            longest = res["length_us"]
            out["detail_step"], out["segments"] = k, res["segments"]
    return out
