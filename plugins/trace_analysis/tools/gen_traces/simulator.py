"""Discrete-event simulation of a Megatron-style MoE job: 1F1B pipeline x expert parallel x data
parallel, tp = cp = 1, rank = dp + DP * stage (Megatron's tp-cp-ep-dp-pp order).

This is the generator's own model of the schedule, independent of the analyzer on purpose: it
produces the ground truth the analyzer is tested against.  Collectives: every member posts, then
all end at max(start over the group) + transfer; a pipeline receive ends at max(receive start,
matching send start) + transfer (send kernels do not wait for their receiver).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from typing import Any

from . import schedule
from .catalogue import (
    BWD_A2A1_OVERLAP,
    BWD_A2A2_OVERLAP,
    BWD_MID,
    BWD_POST,
    BWD_PRE,
    FWD_A2A1_OVERLAP,
    FWD_MID,
    FWD_POST,
    FWD_PRE,
    S_COMP,
    S_EP,
    Recipe,
)
from .config import Config
from .lanes import Lane
from .meta import header_of, meta_events
from .writer import Writer

TidOf = Callable[[Lane], int]


def tid_main(ln: Lane) -> int:
    """The main (forward) thread."""
    return ln.tid_main


def tid_bwd(ln: Lane) -> int:
    """The autograd (backward) thread."""
    return ln.tid_bwd


class Sim:
    """All ranks of the job; ``run()`` writes every trace and returns the event counts."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.pp, self.dp, self.ep = cfg.pp, cfg.dp, cfg.ep
        self.world = cfg.pp * cfg.dp
        os.makedirs(cfg.out, exist_ok=True)
        self.lanes: dict[int, Lane] = {}
        for r in range(self.world):
            header = header_of(cfg, r, self.world, self.process_groups(r))
            trailer = {
                "traceName": f"rank-{r}.json",
                "displayTimeUnit": "ms",
                "baseTimeNanoseconds": 1700000000000000000,
            }
            ext = ".json.gz" if cfg.gzip else ".json"
            w = Writer(os.path.join(cfg.out, f"rank-{r}{ext}"), header, trailer, cfg.gzip)
            self.lanes[r] = Lane(cfg, r, w, random.Random(cfg.seed * 100003 + r))

    # ---- groups --------------------------------------------------------------------------
    def coords(self, r: int) -> tuple[int, int]:
        """(stage, data-parallel index) of rank ``r``."""
        return r // self.dp, r % self.dp

    def rank(self, s: int, d: int) -> int:
        """The rank at stage ``s``, data-parallel index ``d``."""
        return d + self.dp * s

    def pp_group(self, d: int) -> list[int]:
        """Ranks of the pipeline through data-parallel index ``d``."""
        return [self.rank(s, d) for s in range(self.pp)]

    def ep_group(self, s: int, d: int) -> list[int]:
        """Ranks of the expert-parallel group of (s, d)."""
        g = d // self.ep
        return [self.rank(s, g * self.ep + i) for i in range(self.ep)]

    def dp_group(self, s: int) -> list[int]:
        """Ranks of stage ``s`` (its data-parallel group)."""
        return [self.rank(s, d) for d in range(self.dp)]

    def edp_group(self, s: int, d: int) -> list[int]:
        """Ranks of the expert-data-parallel group of (s, d)."""
        return [self.rank(s, dd) for dd in range(self.dp) if dd % self.ep == d % self.ep]

    def process_groups(self, r: int) -> list[dict[str, Any]]:
        """PyTorch's ``distributedInfo.pg_config`` entries of rank ``r``."""
        s, d = self.coords(r)
        groups = [
            ("0", "default_pg", list(range(self.world))),
            ("1", "pp_group", self.pp_group(d)),
            ("2", "ep_group", self.ep_group(s, d)),
            ("3", "dp_group", self.dp_group(s)),
            ("4", "expert_dp_group", self.edp_group(s, d)),
        ]
        return [
            {
                "pg_name": n,
                "pg_desc": desc,
                "backend_config": "cuda:nccl",
                "pg_size": len(g),
                "ranks": g,
            }
            for n, desc, g in groups
        ]

    # ---- collectives ---------------------------------------------------------------------
    def collective(
        self,
        lanes: list[Lane],
        coll: str,
        kind: str,
        stream: int,
        tid_of: TidOf,
        nelems: int,
        xfer_us: float,
        pg: tuple[str, str] = ("0", "default_pg"),
    ) -> None:
        """All members post; all end together at max(start over the group) + transfer."""
        group = [ln.rank for ln in lanes]
        posts = [ln.nccl_post(coll, kind, stream, tid_of(ln), group, nelems, pg=pg) for ln in lanes]
        t_all = max(p[0] for p in posts)
        x = xfer_us * math.exp(lanes[0].rng.gauss(0, 0.08))
        for ln, (st, pend) in zip(lanes, posts):
            ln.finish_kernel(pend, st, t_all + x + ln.rng.uniform(0, 3.0))

    def a2a(self, lanes: list[Lane], tid_of: TidOf, overlap: Recipe) -> None:
        """One expert all-to-all with ``overlap`` (shared expert) on the compute stream."""
        recs = [ln.event_record(S_COMP, tid_of(ln)) for ln in lanes]
        for ln, rec in zip(lanes, recs):
            ln.stream_wait(S_EP, rec, tid_of(ln))
        xfer = self.cfg.a2a_us * (1.0 + 0.3 * lanes[0].rng.random())
        nelems = 4096 * 7168 * 8 // len(lanes)
        self.collective(
            lanes, "all_to_allv", "sendrecv", S_EP, tid_of, nelems, xfer, pg=("2", "ep_group")
        )
        for ln in lanes:
            tid = tid_of(ln)
            rec = ln.event_record(S_EP, tid)
            ln.run(overlap, tid)
            ln.stream_wait(S_COMP, rec, tid)

    def layer(self, lanes: list[Lane], kind: str, m: int, layer: int) -> None:
        """One transformer layer, forward ("F") or backward ("B"), of micro-batch ``m``."""
        if kind == "F":
            for ln in lanes:
                ln.fwd_anchor[(m, layer)] = ln.cpu  # the next cpu_op starts exactly here
                ln.run(FWD_PRE, ln.tid_main)
            self.a2a(lanes, tid_main, FWD_A2A1_OVERLAP)
            for ln in lanes:
                ln.run(FWD_MID, ln.tid_main)
            self.a2a(lanes, tid_main, [])
            for ln in lanes:
                ln.run(FWD_POST, ln.tid_main)
            return
        for ln in lanes:
            t = ln.cpu
            name = "autograd::engine::evaluate_function: UnpermuteMoE_topKBackward"
            d = ln.j(4.0, 0.2)
            ln.cpu_x("cpu_op", name, t, d, ln.tid_bwd)
            if self.cfg.fwdbwd and (m, layer) in ln.fwd_anchor:
                ln.fb += 1
                ts_f = ln.fwd_anchor.pop((m, layer))
                ln.w.add(
                    f'{{"ph": "s", "id": {ln.fb}, "pid": {ln.pid}, "tid": {ln.tid_main}, '
                    f'"ts": {ts_f:.3f}, "cat": "fwdbwd", "name": "fwdbwd"}}'
                )
                ln.w.add(
                    f'{{"ph": "f", "id": {ln.fb}, "pid": {ln.pid}, "tid": {ln.tid_bwd}, '
                    f'"ts": {t:.3f}, "cat": "fwdbwd", "name": "fwdbwd", "bp": "e"}}'
                )
            ln.cpu += d + 0.5
            ln.run(BWD_PRE, ln.tid_bwd)
        self.a2a(lanes, tid_bwd, BWD_A2A1_OVERLAP)
        for ln in lanes:
            ln.run(BWD_MID, ln.tid_bwd)
        self.a2a(lanes, tid_bwd, BWD_A2A2_OVERLAP)
        for ln in lanes:
            ln.run(BWD_POST, ln.tid_bwd)

    # ---- the job -------------------------------------------------------------------------
    def run(self) -> dict[int, int]:
        """Simulate every step on every rank; returns events written per rank."""
        cfg = self.cfg
        for step in range(cfg.steps):
            starts = {}
            for r, ln in self.lanes.items():
                starts[r] = ln.cpu
                ln.begin_step()
                name = "Optimizer.zero_grad#DistributedOptimizer.zero_grad"
                ln.cpu_x("cpu_op", name, ln.cpu, 40.0, ln.tid_main)
                ln.cpu += 42.0
            for g in range(self.dp // self.ep):
                schedule.pipeline(self, g)
            for s in range(self.pp):
                schedule.step_end(self, s)
            for r, ln in self.lanes.items():
                ln.ext += 1
                ln.cpu += 8.0
                name = f"ProfilerStep#{cfg.first_step + step}"
                ln.cpu_x("user_annotation", name, starts[r], ln.cpu - starts[r], ln.tid_main)
                ln.cpu += 15.0
        counts = {}
        for r, ln in self.lanes.items():
            meta_events(self.cfg, ln)
            counts[r] = ln.w.close()
        return counts
