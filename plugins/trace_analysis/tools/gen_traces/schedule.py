"""The 1F1B pipeline schedule and the end of a step (gradient reduce-scatter, optimizer,
parameter all-gather), driving :class:`gen_traces.simulator.Sim`'s lanes.

Kept apart from the analyzer on purpose: an independent model of Megatron's schedule is what
makes the generated ground truth a test of the analyzer rather than a copy of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .catalogue import (
    ADAM,
    CE_B,
    CE_F,
    EMB_B,
    EMB_F,
    GEMM_L,
    GEMM_M,
    GEMM_W,
    L2NORM,
    REDUCE,
    RMS_F,
    S_COMP,
    S_DP,
    S_PP,
    SCALE,
)
from .lanes import Lane

if TYPE_CHECKING:
    from .simulator import Sim

Sent = dict[tuple[str, int, int], list[float]]  # (kind, micro-batch, stage) -> send starts


def schedule_1f1b(pp: int, s: int, microbatches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order of stage ``s``: warm-up, steady 1F1B, cool-down."""
    warm = min(pp - s - 1, microbatches)
    ops = [("F", m) for m in range(warm)]
    for i in range(microbatches - warm):
        ops.append(("F", warm + i))
        ops.append(("B", i))
    ops += [("B", m) for m in range(microbatches - warm, microbatches)]
    return ops


def _tid(ln: Lane, kind: str) -> int:
    return ln.tid_main if kind == "F" else ln.tid_bwd


def p2p_recv(sim: Sim, lanes: list[Lane], kind: str, s: int, send_starts: list[float]) -> None:
    """Receive activations (F) or gradients (B); the compute stream waits for them."""
    for i, ln in enumerate(lanes):
        peer = sim.rank(s - 1 if kind == "F" else s + 1, sim.coords(ln.rank)[1])
        st, pend = ln.nccl_post(
            "recv",
            "sendrecv",
            S_PP,
            _tid(ln, kind),
            [peer, ln.rank],
            4096 * 7168,
            pg=("1", "pp_group"),
            peer=peer,
        )
        end = max(st, send_starts[i]) + ln.j(sim.cfg.p2p_us, 0.05)
        ln.finish_kernel(pend, st, end)
        if ln.truth:
            ln.truth[-1].recv.append((st, end))
        rec = ln.event_record(S_PP, _tid(ln, kind))
        ln.stream_wait(S_COMP, rec, _tid(ln, kind))


def p2p_send(sim: Sim, lanes: list[Lane], kind: str, s: int) -> list[float]:
    """Send activations (F) or gradients (B); returns the send kernels' start times."""
    starts = []
    for ln in lanes:
        rec = ln.event_record(S_COMP, _tid(ln, kind))
        ln.stream_wait(S_PP, rec, _tid(ln, kind))
        peer = sim.rank(s + 1 if kind == "F" else s - 1, sim.coords(ln.rank)[1])
        st, pend = ln.nccl_post(
            "send",
            "sendrecv",
            S_PP,
            _tid(ln, kind),
            [ln.rank, peer],
            4096 * 7168,
            pg=("1", "pp_group"),
            peer=peer,
        )
        ln.finish_kernel(pend, st, st + ln.j(sim.cfg.p2p_us, 0.05))
        starts.append(st)
    return starts


def run_op(sim: Sim, s: int, kind: str, m: int, lanes: list[Lane], sent: Sent) -> None:
    """One forward or backward of micro-batch ``m`` on stage ``s`` (all its EP lanes)."""
    last = sim.pp - 1
    if kind == "F":
        if s > 0:
            p2p_recv(sim, lanes, "F", s, sent[("F", m, s - 1)])
        else:
            for ln in lanes:
                ln.launch(
                    ["VocabParallelEmbedding", "aten::embedding"], EMB_F, 60, 4096, 128, ln.tid_main
                )
        for layer in range(sim.cfg.layers):
            sim.layer(lanes, "F", m, layer)
        if s < last:
            sent[("F", m, s)] = p2p_send(sim, lanes, "F", s)
        else:
            for ln in lanes:
                tid = ln.tid_main
                ln.launch(["_LayerNormLinear", "tex::rmsnorm_fwd"], RMS_F, 38, 4096, 256, tid)
                ln.launch(["ColumnParallelLinear", "tex::generic_gemm"], GEMM_L, 900, 132, 384, tid)
                ln.launch(["_VocabParallelCrossEntropy", "aten::max"], REDUCE, 80, 4096, 512, tid)
                ln.launch(["_VocabParallelCrossEntropy", "aten::exp"], CE_F, 90, 4096, 256, tid)
        return
    if s < last:
        p2p_recv(sim, lanes, "B", s, sent[("B", m, s + 1)])
    else:
        for ln in lanes:
            tid = ln.tid_bwd
            ln.launch(["_VocabParallelCrossEntropyBackward", "aten::mul"], CE_B, 90, 4096, 256, tid)
            ln.launch(
                ["ColumnParallelLinearBackward", "tex::generic_gemm"], GEMM_M, 900, 132, 384, tid
            )
            ln.launch(
                ["ColumnParallelLinearBackward", "tex::generic_gemm"], GEMM_W, 900, 132, 384, tid
            )
    for layer in reversed(range(sim.cfg.layers)):
        sim.layer(lanes, "B", m, layer)
    if s > 0:
        sent[("B", m, s)] = p2p_send(sim, lanes, "B", s)
    else:
        for ln in lanes:
            ln.launch(
                ["EmbeddingBackward0", "aten::embedding_dense_backward"],
                EMB_B,
                120,
                4096,
                128,
                ln.tid_bwd,
            )
    for ln in lanes:  # the main thread resumes after backward
        ln.cpu += ln.j(5.0)


def pipeline(sim: Sim, g: int) -> None:
    """Run every stage's 1F1B order for expert group ``g`` (a stage blocks on missing input)."""
    pp, microbatches = sim.pp, sim.cfg.microbatches
    ops = [schedule_1f1b(pp, s, microbatches) for s in range(pp)]
    lanes = [[sim.lanes[sim.rank(s, g * sim.ep + i)] for i in range(sim.ep)] for s in range(pp)]
    ptr = [0] * pp
    sent: Sent = {}
    while any(ptr[s] < len(ops[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while ptr[s] < len(ops[s]):
                kind, m = ops[s][ptr[s]]
                if kind == "F" and s > 0 and ("F", m, s - 1) not in sent:
                    break
                if kind == "B" and s < pp - 1 and ("B", m, s + 1) not in sent:
                    break
                run_op(sim, s, kind, m, lanes[s], sent)
                ptr[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline deadlock")


def step_end(sim: Sim, s: int) -> None:
    """Gradient reduce-scatter, grad-norm all-reduce, Adam, parameter all-gather of stage s."""
    cfg = sim.cfg
    lanes = [sim.lanes[r] for r in sim.dp_group(s)]

    def main(ln: Lane) -> int:
        return ln.tid_main

    for ln in lanes:  # wait for backward (compute stream) before the gradient reduce-scatter
        ln.stream_wait(S_DP, ln.event_record(S_COMP, ln.tid_main), ln.tid_main)
    for _ in range(cfg.buckets):
        sim.collective(
            lanes,
            "reduce_scatter_tensor_coalesced",
            "reduce_scatter",
            S_DP,
            main,
            40_000_000,
            cfg.dp_us,
            pg=("3", "dp_group"),
        )
    for e in range(sim.ep):
        sub = [ln for ln in lanes if sim.coords(ln.rank)[1] % sim.ep == e]
        if len(sub) > 1:
            for _ in range(cfg.buckets):
                sim.collective(
                    sub,
                    "reduce_scatter_tensor_coalesced",
                    "reduce_scatter",
                    S_DP,
                    main,
                    80_000_000,
                    cfg.dp_us,
                    pg=("4", "expert_dp_group"),
                )
    for ln in lanes:
        ln.stream_wait(S_COMP, ln.event_record(S_DP, ln.tid_main), ln.tid_main)
        for _ in range(4):
            ln.launch(
                ["DistributedOptimizer.step", "multi_tensor_l2norm"],
                L2NORM,
                90,
                1320,
                512,
                ln.tid_main,
            )
    sim.collective(lanes, "all_reduce", "all_reduce", S_COMP, main, 1, 30.0, pg=("3", "dp_group"))
    for ln in lanes:
        ln.d2h_sync(ln.tid_main)  # grad_norm.item()
        for _ in range(2):
            ln.launch(
                ["DistributedOptimizer.step", "multi_tensor_scale"],
                SCALE,
                120,
                1320,
                512,
                ln.tid_main,
            )
        for _ in range(cfg.adam_kernels):
            ln.launch(
                ["DistributedOptimizer.step", "FusedAdam.step", "multi_tensor_adam"],
                ADAM,
                220,
                1320,
                512,
                ln.tid_main,
            )
        ln.stream_wait(S_DP, ln.event_record(S_COMP, ln.tid_main), ln.tid_main)
    for _ in range(cfg.buckets):
        sim.collective(
            lanes,
            "all_gather_into_tensor_coalesced",
            "all_gather",
            S_DP,
            main,
            20_000_000,
            cfg.dp_us * 0.8,
            pg=("3", "dp_group"),
        )
    for ln in lanes:
        ln.stream_wait(S_COMP, ln.event_record(S_DP, ln.tid_main), ln.tid_main)
