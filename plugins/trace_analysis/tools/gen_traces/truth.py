"""Ground truth from the simulator's own clocks (never read back from the written files).

Per rank and step:
* the device step window: from the later of the step's first GPU op and the end of the rank's
  previous step on the device, to the end of the step's last GPU op (GPU ops are attributed to the
  step during which the CPU launched them);
* the pipeline stall: how long the compute stream's ops started later than they would have
  without their waits on pipeline receives, inside that window;
* compute time (compute-kernel time, whatever it waited for).

Per stage: mean stall ratio, stall and window over its ranks and steps.  Job step time: latest
GPU end of the step over all ranks minus that of the previous step (first step: minus the
earliest ProfilerStep start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .lanes import Interval

if TYPE_CHECKING:
    from .simulator import Sim


def union(intervals: list[Interval]) -> list[list[float]]:
    """Sorted, merged copy of a list of (start, end) intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def clipped(merged: list[list[float]], lo: float, hi: float) -> float:
    """Length of a merged interval list inside [lo, hi]."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged)


def ground_truth(sim: Sim) -> dict[str, Any]:
    """Per rank, per stage and per step truth of a finished simulation."""
    cfg = sim.cfg
    step_time = []
    prev = min(ln.truth[0].start for ln in sim.lanes.values())
    for k in range(cfg.steps):
        t1 = max(ln.truth[k].gpu_end for ln in sim.lanes.values())
        step_time.append(t1 - prev)
        prev = t1
    by_rank: dict[int, list[dict[str, float]]] = {}
    for r, ln in sim.lanes.items():
        rows = []
        prev_end = float("-inf")
        for tr in ln.truth:
            w0, w1 = max(tr.gpu_start, prev_end), tr.gpu_end
            prev_end = w1
            rows.append(
                {
                    "window_us": w1 - w0,
                    "stall_us": clipped(union(tr.stall), w0, w1),
                    "compute_us": sum(b - a for a, b in union(tr.comp)),
                }
            )
        by_rank[r] = rows
    stages = []
    for s in range(sim.pp):
        rows = [row for d in range(sim.dp) for row in by_rank[sim.rank(s, d)]]
        stages.append(
            {
                "stage": s,
                "stall_ratio": sum(x["stall_us"] / x["window_us"] for x in rows) / len(rows),
                "stall_us": sum(x["stall_us"] for x in rows) / len(rows),
                "window_us": sum(x["window_us"] for x in rows) / len(rows),
            }
        )
    return {
        "slow_ranks": sorted(cfg.slow_ranks),
        "slow_factor": cfg.slow_factor,
        "step_time_us": step_time,
        "bubble_ratio_by_stage": [x["stall_ratio"] for x in stages],
        "stages": stages,
        "by_rank": {str(r): v for r, v in by_rank.items()},
    }
