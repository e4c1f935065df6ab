"""Command line: ``python -m gen_traces --out DIR --ranks R ...`` (with ``tools/`` on sys.path).

Writes one Kineto trace per rank into DIR and ``DIR.geninfo.json`` (outside DIR: trace readers
load every ``*.json`` inside it) with the configuration and the ground truth.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .config import Config
from .simulator import Sim
from .truth import ground_truth

# Calibrated (8 ranks, M=8, 3 steps): L=1 -> 11959..12739 events/rank, L=2 -> 22303..23083.
EVENTS_PER_LAYER_MB = 431  # events per (layer x micro-batch), forward + backward
EVENTS_OVERHEAD_PER_STEP = 540


def build_parser() -> argparse.ArgumentParser:
    """The generator's command line."""
    ap = argparse.ArgumentParser(prog="gen_traces", description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--pp", type=int, default=0, help="stages (default: 4 up to 32 ranks, else 8)")
    ap.add_argument("--ep", type=int, default=0, help="expert-parallel size (default min(8, dp))")
    ap.add_argument("--events", type=int, default=20000, help="events per rank (sets --layers)")
    ap.add_argument("--layers", type=int, default=0, help="layers per stage (overrides --events)")
    ap.add_argument("--microbatches", type=int, default=0, help="default 2*pp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--first-step", type=int, default=10)
    ap.add_argument("--slow-ranks", default="", help="comma list (default: one mid rank)")
    ap.add_argument("--slow-stages", default="", help="comma list of whole slow stages")
    ap.add_argument("--slow-nodes", default="", help="comma list of slow nodes (--ranks-per-node)")
    ap.add_argument("--slow-factor", type=float, default=1.3)
    ap.add_argument("--ranks-per-node", type=int, default=0, help="write host_name metadata")
    ap.add_argument("--a2a-us", type=float, default=450.0)
    ap.add_argument("--p2p-us", type=float, default=300.0)
    ap.add_argument("--dp-us", type=float, default=4000.0)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--adam-kernels", type=int, default=12)
    ap.add_argument("--nccl-naming", choices=["modern", "legacy", "rccl", "mccl"], default="modern")
    ap.add_argument("--no-collective-args", action="store_true", help="older PyTorch: no args")
    ap.add_argument("--no-annotations", action="store_true", help="no nccl:* profiling titles")
    ap.add_argument("--no-rank", action="store_true", help="distributedInfo without the rank")
    ap.add_argument("--no-cuda-sync", action="store_true")
    ap.add_argument("--no-fwdbwd", action="store_true")
    ap.add_argument("--no-gzip", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def config_from(a: argparse.Namespace) -> tuple[Config, list[dict[str, Any]]]:
    """The simulation's configuration and its slow units from parsed arguments."""
    pp = min(a.pp or (4 if a.ranks <= 32 else 8), a.ranks)
    if a.ranks % pp:
        raise SystemExit("gen_traces: --ranks must be a multiple of --pp")
    dp = a.ranks // pp
    ep = a.ep or min(8, dp)
    if dp % ep:
        raise SystemExit("gen_traces: the data-parallel size must be a multiple of --ep")
    mbs = a.microbatches or 2 * pp
    per_step = a.events / a.steps - EVENTS_OVERHEAD_PER_STEP
    layers = a.layers or max(1, round(per_step / (mbs * EVENTS_PER_LAYER_MB)))
    units: list[dict[str, Any]] = []
    slow = set(_ints(a.slow_ranks))
    for s in _ints(a.slow_stages):
        slow |= {d + dp * s for d in range(dp)}
        units.append({"unit": "stage", "id": s})
    if a.slow_nodes and not a.ranks_per_node:
        raise SystemExit("gen_traces: --slow-nodes needs --ranks-per-node")
    for n in _ints(a.slow_nodes):
        slow |= set(range(n * a.ranks_per_node, (n + 1) * a.ranks_per_node))
        units.append({"unit": "node", "id": f"node-{n}"})
    units += [{"unit": "rank", "id": r} for r in _ints(a.slow_ranks)]
    if not (a.slow_ranks or a.slow_stages or a.slow_nodes):
        slow = {a.ranks // 2 + 1 if a.ranks > 1 else 0}
        units = [{"unit": "rank", "id": min(slow)}]
    cfg = Config(
        out=a.out,
        pp=pp,
        dp=dp,
        ep=ep,
        layers=layers,
        microbatches=mbs,
        steps=a.steps,
        first_step=a.first_step,
        slow_ranks=slow,
        slow_factor=a.slow_factor,
        a2a_us=a.a2a_us,
        p2p_us=a.p2p_us,
        dp_us=a.dp_us,
        buckets=a.buckets,
        adam_kernels=a.adam_kernels,
        naming=a.nccl_naming,
        collective_args=not a.no_collective_args,
        annotations=not a.no_annotations,
        ranks_per_node=a.ranks_per_node,
        rank_in_header=not a.no_rank,
        cuda_sync=not a.no_cuda_sync,
        fwdbwd=not a.no_fwdbwd,
        gzip=not a.no_gzip,
        seed=a.seed,
    )
    return cfg, units


def generate(argv: list[str] | None) -> dict[str, Any]:
    """Write one trace per rank into --out; return the info dict with its "truth"."""
    a = build_parser().parse_args(argv)
    cfg, units = config_from(a)
    t0 = time.time()
    sim = Sim(cfg)
    counts = sim.run()
    truth = ground_truth(sim)
    truth["slow_units"] = units
    return {
        "ranks": a.ranks,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "ep": cfg.ep,
        "layers_per_stage": cfg.layers,
        "microbatches": cfg.microbatches,
        "steps": cfg.steps,
        "slow_ranks": sorted(cfg.slow_ranks),
        "slow_factor": cfg.slow_factor,
        "nccl_naming": cfg.naming,
        "ranks_per_node": cfg.ranks_per_node,
        "events_per_rank_min": min(counts.values()),
        "events_per_rank_max": max(counts.values()),
        "events_total": sum(counts.values()),
        "gen_seconds": round(time.time() - t0, 1),
        "truth": truth,
    }


def main(argv: list[str] | None = None) -> None:
    """Generate, then write <out>.geninfo.json next to (not inside) the trace directory."""
    a = build_parser().parse_args(argv)
    info = generate(argv)
    with open(a.out.rstrip("/") + ".geninfo.json", "w") as fh:
        json.dump(info, fh, indent=1)
    print(json.dumps({k: v for k, v in info.items() if k != "truth"}))
