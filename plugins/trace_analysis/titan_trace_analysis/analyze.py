"""Orchestration: find traces, run the map step, then the cross-rank analyses on summaries."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from . import critical_path as cp
from .crossrank import bubbles_by_stage, check_ranks, common_steps, per_rank_table, slow_ranks
from .engine import run_map

TRACE_SUFFIXES = (".json", ".json.gz", ".gz")


def find_traces(trace_dir: str) -> list[str]:
    """Trace files directly in ``trace_dir`` (plain or gzipped JSON), sorted by name."""
    names = sorted(os.listdir(trace_dir))
    return [
        os.path.join(trace_dir, n)
        for n in names
        if n.endswith(TRACE_SUFFIXES)
        and not n.endswith(".timeline.json")
        and os.path.isfile(os.path.join(trace_dir, n))
    ]


def analyze(
    trace_dir: str,
    out_dir: str,
    engine: str = "local",
    workers: int = 0,
    progress: bool | None = None,
    slow_threshold: float = 1.10,
    ray_address: str | None = None,
    keep_timelines: bool = False,
) -> dict[str, Any]:
    """Analyse every trace in ``trace_dir``; returns the report (also the JSON output)."""
    t0 = time.monotonic()
    paths = find_traces(trace_dir)
    tl_dir = os.path.join(out_dir, "timelines")
    os.makedirs(tl_dir, exist_ok=True)
    summaries = run_map(paths, tl_dir, engine, workers, progress, ray_address)
    t_map = time.monotonic() - t0
    by_rank, problems = check_ranks(summaries)
    steps = common_steps(by_rank)
    table = per_rank_table(by_rank, steps)
    report: dict[str, Any] = {
        "trace_dir": os.path.abspath(trace_dir),
        "files": len(paths),
        "ranks_analyzed": len(by_rank),
        "events": sum(s.get("events", 0) for s in summaries),
        "steps": steps,
        "problems": problems,
        "partial": bool(problems),
        "ranks": {
            str(r): {
                "file": s["file"],
                "coords": s["coords"],
                "temporal": s.get("temporal"),
                "mean_per_step": table.get(r),
            }
            for r, s in sorted(by_rank.items())
        },
        "stages": bubbles_by_stage(by_rank, table),
        "slow_ranks": slow_ranks(by_rank, table, slow_threshold),
        "critical_path": _critical_paths(by_rank, steps),
    }
    report["seconds"] = {"map": t_map, "total": time.monotonic() - t0}
    if not paths:
        report["problems"].append({"file": trace_dir, "problem": "no *.json / *.json.gz traces"})
        report["partial"] = True
    if not keep_timelines:
        shutil.rmtree(tl_dir, ignore_errors=True)
    return report


def _critical_paths(by_rank: dict[int, dict], steps: list[str]) -> dict[str, Any]:
    paths = {r: s["timeline"] for r, s in by_rank.items() if s.get("timeline")}
    stage_of = {r: int(s["coords"].get("pp", 0)) for r, s in by_rank.items()}
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
        res = cp.walk(cp.Timelines(paths, k, latest=latest), ends, stop)
        out["steps"][k] = {
            "length_us": res["length_us"],
            "start_us": res["start_us"],
            "end_us": res["end_us"],
            "unresolved_peers": res["unresolved_peers"],
            **cp.bound_by(res, stage_of),
        }
        if res["length_us"] > longest:
            longest = res["length_us"]
            out["detail_step"], out["segments"] = k, res["segments"]
    return out
