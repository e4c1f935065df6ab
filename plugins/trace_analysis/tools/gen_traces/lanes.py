"""One rank's state in the simulation (CPU clock, stream clocks) and the events it writes.

GPU start = max(launch + latency, stream free, cross-stream dependency).  The lane also keeps its
ground truth per step: the GPU window, compute intervals, pipeline receives and the pipeline
stalls of the compute stream (how long each compute op started later than it would have without
a wait on a pipeline receive), all from the simulator's own clocks.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

from .catalogue import ANNOTATION_PREFIX, EXTRA_CPU, NAMINGS, S_COMP, S_DP, S_EP, S_PP, Recipe
from .config import Config
from .writer import Writer

Interval = tuple[float, float]


@dataclass
class StepTruth:
    """What the simulator knows about one rank's step (GPU ops launched during the step)."""

    start: float  # CPU time the step began (its ProfilerStep start)
    gpu_start: float = math.inf
    gpu_end: float = 0.0
    comp: list[Interval] = field(default_factory=list)
    recv: list[Interval] = field(default_factory=list)
    stall: list[Interval] = field(default_factory=list)  # compute stream held by a PP receive


@dataclass
class Pending:
    """A communication kernel whose end is known only when every member has posted."""

    corr: int
    rt_ts: float
    tid: int
    name: str
    grid: int
    block: int
    extra_args: str
    stream: int
    cat: str


Record = tuple[int, int, int, float]  # (correlation, event id, stream, completion time)


def q(text: str) -> str:
    """JSON string literal."""
    return json.dumps(text)


class Lane:
    """State of one rank; every ``add`` writes one event to its file."""

    def __init__(self, cfg: Config, rank: int, writer: Writer, rng: random.Random) -> None:
        self.cfg, self.rank, self.w, self.rng = cfg, rank, writer, rng
        self.names = NAMINGS[cfg.naming]
        self.prefix = ANNOTATION_PREFIX[cfg.naming]
        self.pid = 100000 + rank * 17
        self.tid_main = self.pid
        self.tid_bwd = self.pid + 5
        self.dev = rank % 8
        self.gpid = self.dev
        self.cpu = cfg.base + rng.uniform(0, 50)  # small per-rank start offset
        self.free = {S_COMP: self.cpu, S_PP: self.cpu, S_EP: self.cpu, S_DP: self.cpu}
        self.free_nopp = self.cpu  # when the compute stream would be free without PP waits
        self.ext = rank * 10_000_000 + 1
        self.corr = rank * 10_000_000 + 1
        self.evid = 1
        self.fb = 1
        self.slow = cfg.slow_factor if rank in cfg.slow_ranks else 1.0
        self.nk = 0
        self.fwd_anchor: dict[tuple[int, int], float] = {}
        self.truth: list[StepTruth] = []

    def begin_step(self) -> None:
        """Open a ground-truth record for the step that starts now (CPU time)."""
        self.truth.append(StepTruth(start=self.cpu))

    # ---- helpers -------------------------------------------------------------------------
    def j(self, mean: float, sig: float = 0.06) -> float:
        """``mean`` with log-normal jitter."""
        return mean * math.exp(self.rng.gauss(0.0, sig))

    def cpu_x(
        self, cat: str, name: str, ts: float, dur: float, tid: int, args: str | None = None
    ) -> None:
        """A complete CPU-side event."""
        a = args if args is not None else f'{{"External id": {self.ext}}}'
        self.w.add(
            f'{{"ph": "X", "cat": "{cat}", "name": {q(name)}, "pid": {self.pid}, "tid": {tid}, '
            f'"ts": {ts:.3f}, "dur": {dur:.3f}, "args": {a}}}'
        )

    def runtime(self, name: str, ts: float, dur: float, tid: int, cbid: int, corr: int) -> None:
        """A CUDA runtime call (launch, event record, wait, sync)."""
        self.w.add(
            f'{{"ph": "X", "cat": "cuda_runtime", "name": "{name}", "pid": {self.pid}, '
            f'"tid": {tid}, "ts": {ts:.3f}, "dur": {dur:.3f}, "args": {{"External id": '
            f'{self.ext}, "cbid": {cbid}, "correlation": {corr}}}}}'
        )

    def flow(self, corr: int, ts_cpu: float, tid: int, ts_gpu: float, stream: int) -> None:
        """The ac2g flow from a launch to its GPU op."""
        self.w.add(
            f'{{"ph": "s", "id": {corr}, "pid": {self.pid}, "tid": {tid}, "ts": {ts_cpu:.3f}, '
            '"cat": "ac2g", "name": "ac2g"}'
        )
        self.w.add(
            f'{{"ph": "f", "id": {corr}, "pid": {self.gpid}, "tid": {stream}, '
            f'"ts": {ts_gpu:.3f}, "cat": "ac2g", "name": "ac2g", "bp": "e"}}'
        )

    def extra_cpu(self, tid: int) -> None:
        """A small aten op between launches (every other launch)."""
        if self.nk % 2 == 0:
            d = self.j(3.0, 0.3)
            self.cpu_x("cpu_op", EXTRA_CPU[self.nk % len(EXTRA_CPU)], self.cpu, d, tid)
            self.cpu += d + 0.6

    # ---- kernel launch -------------------------------------------------------------------
    def launch(
        self,
        stack: list[str],
        kname: str,
        gpu_us: float,
        grid: int,
        block: int,
        tid: int,
        stream: int = S_COMP,
        dep: float = 0.0,
        scale: bool = True,
        runtime_name: str = "cudaLaunchKernel",
        cbid: int = 211,
        extra_args: str = "",
        cat: str = "kernel",
        defer: bool = False,
    ) -> tuple[float, float, Pending | None]:
        """CPU side: nested cpu_ops + runtime call + flow start; GPU side: the op + flow end.

        Returns (start, end, pending); with ``defer`` the op is written later by
        :meth:`finish_kernel` (collectives end when every member has posted) and end is nan.
        """
        self.extra_cpu(tid)
        self.ext += 1
        self.corr += 1
        corr = self.corr
        t = self.cpu
        opened = []
        for name in stack:
            opened.append((name, t))
            t += self.j(2.5, 0.3)
        rt_dur = self.j(5.0, 0.25)
        rt_ts = t
        self.runtime(runtime_name, rt_ts, rt_dur, tid, cbid, corr)
        t = rt_ts + rt_dur
        for name, t0 in reversed(opened):
            t += self.j(1.2, 0.3)
            self.cpu_x("cpu_op", name, t0, t - t0, tid)
        self.cpu = t + self.j(4.0, 0.4)  # python overhead between ops
        ready = rt_ts + self.j(3.0, 0.2)
        start = max(ready, self.free[stream], dep)
        if stream == S_COMP and self.truth:
            natural = max(ready, self.free_nopp, dep)
            if start > natural:  # held by a wait on a pipeline receive
                self.truth[-1].stall.append((natural, start))
        dur = self.j(gpu_us) * (self.slow if scale else 1.0)
        self.nk += 1
        pend = Pending(corr, rt_ts, tid, kname, grid, block, extra_args, stream, cat)
        if defer:
            return start, math.nan, pend
        self.finish_kernel(pend, start, start + dur)
        return start, start + dur, None

    def finish_kernel(self, pend: Pending, start: float, end: float) -> None:
        """Write the GPU op of ``pend`` running from ``start`` to ``end``."""
        self.free[pend.stream] = end
        if pend.stream == S_COMP:
            self.free_nopp = end
        if self.truth:
            tr = self.truth[-1]
            tr.gpu_start = min(tr.gpu_start, start)
            tr.gpu_end = max(tr.gpu_end, end)
            if pend.cat == "kernel" and pend.name not in self.names.values():
                tr.comp.append((start, end))
        dur = end - start
        if pend.cat == "gpu_memcpy":
            self.w.add(
                f'{{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", '
                f'"pid": {self.gpid}, "tid": {pend.stream}, "ts": {start:.3f}, "dur": {dur:.3f}, '
                f'"args": {{"External id": {self.ext}, "device": {self.dev}, "context": 1, '
                f'"stream": {pend.stream}, "correlation": {pend.corr}, "bytes": 1024, '
                '"memory bandwidth (GB/s)": 0.5}}'
            )
        else:
            self.w.add(
                f'{{"ph": "X", "cat": "kernel", "name": {q(pend.name)}, "pid": {self.gpid}, '
                f'"tid": {pend.stream}, "ts": {start:.3f}, "dur": {dur:.3f}, "args": {{'
                f'"External id": {self.ext}, "queued": 0, "device": {self.dev}, "context": 1, '
                f'"stream": {pend.stream}, "correlation": {pend.corr}, '
                '"registers per thread": 128, "shared memory": 65536, '
                f'"blocks per SM": {pend.grid / 132.0:.6f}, '
                f'"warps per SM": {pend.grid * pend.block / 32.0 / 132.0:.6f}, '
                f'"grid": [{pend.grid}, 1, 1], "block": [{pend.block}, 1, 1], '
                f'"est. achieved occupancy %": 25{pend.extra_args}}}}}'
            )
        self.flow(pend.corr, pend.rt_ts, pend.tid, start, pend.stream)

    # ---- stream/event sync ---------------------------------------------------------------
    def event_record(self, stream: int, tid: int) -> Record:
        """cudaEventRecord on ``stream``: completes when the stream's queued work does."""
        self.ext += 1
        self.corr += 1
        d = self.j(2.0, 0.2)
        self.runtime("cudaEventRecord", self.cpu, d, tid, 135, self.corr)
        self.cpu += d + 0.5
        self.evid += 1
        return (self.corr, self.evid, stream, self.free[stream])

    def stream_wait(self, dst: int, rec: Record, tid: int) -> None:
        """cudaStreamWaitEvent: ``dst`` waits for the recorded event."""
        rcorr, evid, src, t_done = rec
        self.ext += 1
        self.corr += 1
        d = self.j(2.0, 0.2)
        rt = self.cpu
        self.runtime("cudaStreamWaitEvent", rt, d, tid, 147, self.corr)
        self.cpu += d + 0.5
        if self.cfg.cuda_sync:
            gts = max(rt + 2.0, self.free[dst])
            self.w.add(
                f'{{"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": {self.gpid}, '
                f'"tid": {dst}, "ts": {gts:.3f}, "dur": 1.000, "args": {{"External id": {self.ext}, '
                f'"cuda_sync_kind": "Stream Wait Event", "wait_on_stream": {src}, '
                f'"wait_on_cuda_event_record_corr_id": {rcorr}, "wait_on_cuda_event_id": {evid}, '
                f'"stream": {dst}, "correlation": {self.corr}, "device": {self.dev}, "context": 1}}}}'
            )
            self.flow(self.corr, rt, tid, gts, dst)
        self.free[dst] = max(self.free[dst], t_done)
        if dst == S_COMP and src != S_PP:  # only waits on a pipeline receive are stalls
            self.free_nopp = max(self.free_nopp, t_done)

    def d2h_sync(self, tid: int) -> None:
        """tokens_per_expert.cpu(): D2H copy + cudaStreamSynchronize (CPU waits for GPU)."""
        _s, e, _ = self.launch(
            ["aten::to", "aten::_to_copy", "aten::copy_"],
            "",
            2.5,
            0,
            0,
            tid,
            runtime_name="cudaMemcpyAsync",
            cbid=41,
            cat="gpu_memcpy",
            scale=False,
        )
        self.ext += 1
        self.corr += 1
        rt = self.cpu
        wait_end = max(rt + 3.0, e + 2.0)
        self.runtime("cudaStreamSynchronize", rt, wait_end - rt, tid, 131, self.corr)
        if self.cfg.cuda_sync:
            self.w.add(
                f'{{"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": {self.gpid}, '
                f'"tid": {S_COMP}, "ts": {e:.3f}, "dur": 1.000, "args": {{"External id": '
                f'{self.ext}, "cuda_sync_kind": "Stream Sync", "stream": {S_COMP}, '
                f'"correlation": {self.corr}, "device": {self.dev}, "context": 1}}}}'
            )
            self.flow(self.corr, rt, tid, e, S_COMP)
        self.cpu = wait_end + self.j(3.0)

    def run(self, recipe: Recipe, tid: int) -> None:
        """Launch every kernel of a recipe (and its D2H syncs)."""
        for item in recipe:
            if isinstance(item, str):
                self.d2h_sync(tid)
            else:
                stack, k, us, g, b = item
                self.launch(stack, k, us, g, b, tid)

    # ---- collectives ---------------------------------------------------------------------
    def nccl_post(
        self,
        coll: str,
        kind: str,
        stream: int,
        tid: int,
        group: list[int],
        nelems: int,
        dep: float = 0.0,
        pg: tuple[str, str] = ("0", "default_pg"),
        peer: int | None = None,
    ) -> tuple[float, Pending]:
        """Post one collective (or send/recv to ``peer``): its profiling title, c10d op and
        deferred kernel; returns (GPU start, pending kernel)."""
        ranks = (
            "[" + ", ".join(str(r) for r in group) + "]"
            if len(group) <= 64
            else f"[{group[0]}, ..., {group[-1]}]"
        )
        cargs = (
            f'"Collective name": "{coll}", "In msg nelems": {nelems}, "Out msg nelems": {nelems}, '
            f'"Group size": {len(group)}, "dtype": "BFloat16", "In split size": "[]", '
            f'"Out split size": "[]", "Process Group Name": "{pg[0]}", '
            f'"Process Group Description": "{pg[1]}", "Process Group Ranks": "{ranks}"'
        )
        if not self.cfg.collective_args:
            cargs = ""
        t0 = self.cpu
        self.ext += 1
        ann_ext = self.ext
        self.cpu += self.j(3.0)
        t1 = self.cpu
        self.cpu += self.j(6.0)
        start, _, pend = self.launch(
            ["record_param_comms"],
            self.names[kind],
            0.0,
            8,
            544,
            tid,
            stream=stream,
            dep=dep,
            scale=False,
            runtime_name="cudaLaunchKernelExC",
            cbid=430,
            extra_args=", " + cargs if cargs else "",
            defer=True,
        )
        assert pend is not None
        t2 = self.cpu
        args = f'{{"External id": {ann_ext}' + (", " + cargs if cargs else "") + "}"
        self.cpu_x("cpu_op", "c10d::" + coll + "_", t1, t2 - t1, tid, args)
        self.cpu += self.j(2.0)
        if self.cfg.annotations:
            if coll == "send":
                title = f"{self.prefix}send {self.rank}->{peer}"
            elif coll == "recv":
                title = f"{self.prefix}recv {self.rank}<-{peer}"
            else:
                title = self.prefix + coll
            ext = f'{{"External id": {ann_ext}}}'
            self.cpu_x("user_annotation", title, t0, self.cpu - t0, tid, ext)
        return start, pend
