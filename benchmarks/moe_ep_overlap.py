"""MoE EP overlap (plugin ``moe_ep_overlap``): MoE layer forward+backward time with the chunked
dispatch/compute/combine pipeline versus megatron's serial flex path, both on the plugin's
torch.distributed backend, measured in the same run.

1. ``plain``: EP=2 on gloo (2 local processes), real loopback all-to-alls. Prints the median
   fwd+bwd time of serial (1 chunk: megatron's flex path) and overlapped (``--chunks``) and their
   ratio. On 2 shared CPU cores loopback gloo is fast next to the expert GEMMs, so expect ~1.0:
   the schedule costs little when there is nothing to hide.
2. ``inject``: the same with a simulated link added to every all-to-all (a serial link whose
   bandwidth is calibrated so the layer's total all-to-all time equals its serial fwd+bwd time,
   ``--comm-ratio 1``; plus ``--latency-ms`` per transfer). Completion of each transfer is
   delayed, the host is not blocked at issue, exactly like a slower network. Goal:
   overlapped / serial <= 0.75 at equal communication and compute.
3. ``gpu``: ``gpu_benchmark()`` - the same comparison on CUDA with NCCL (and DeepEP, if a
   compatible v1 is installed: the plugin picks it), one process per GPU. Needs >= 2 GPUs; it is
   skipped with a message otherwise.

Rounds alternate serial and overlapped, so machine load hits both alike; medians are printed.

    .venv/bin/python benchmarks/moe_ep_overlap.py [--section plain|inject|gpu|all] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

ENV = {"TITAN_MOE_EP_OVERLAP_BACKEND": "torch"}


def _moe_layer(shape: dict, cpu: bool = True) -> Any:
    """A megatron MoELayer (flex dispatcher, DeepEP backend name) of the given shape."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
        num_attention_heads=8, num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
        moe_token_dispatcher_type="flex", moe_router_dtype="fp32", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        use_cpu_initialization=cpu, add_bias_linear=False, hidden_dropout=0.0,
        bf16=not cpu, params_dtype=torch.float32 if cpu else torch.bfloat16,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts)
    return build_module(spec.submodules.mlp, config=cfg)


def _step(layer: Any, x: Any, grad: Any, chunks: int, sync: Any) -> float:
    import torch

    os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = str(chunks)
    sync()
    # The CPU test harness routes every torch call through a TorchFunctionMode (device rewrites,
    # a few us per op) that real runs never have and that would tax the chunked schedule (more,
    # smaller ops) unfairly; the timed region needs none of its rewrites.
    with torch._C.DisableTorchFunction():
        start = time.perf_counter()
        out, _ = layer(x)
        out.backward(grad)
        sync()
        return time.perf_counter() - start


def _compare(layer: Any, x: Any, grad: Any, chunks: int, rounds: int, sync: Any) -> dict:
    """Medians of alternating serial / overlapped steps and their ratio (the GPU section)."""
    for c in (1, chunks):  # warm-up: allocator, buffers, first-call paths
        _step(layer, x, grad, c, sync)
    serial, overlap = [], []
    for _ in range(rounds):
        serial.append(_step(layer, x, grad, 1, sync))
        overlap.append(_step(layer, x, grad, chunks, sync))
    s, o = statistics.median(serial), statistics.median(overlap)
    return {"serial_ms": 1e3 * s, "overlap_ms": 1e3 * o, "ratio": o / s}


def _timed(layer: Any, x: Any, grad: Any, chunks: int, link: tuple | None) -> tuple:
    """One step with (``link`` = (s/byte, latency)) or without the simulated link.

    Returns ``(step seconds, compute seconds = step minus host time waiting for transfers)``.
    """
    import torch.distributed as dist
    from titan_moe_ep_overlap import comm

    if link is not None:
        comm.set_link_model(*link)
    try:
        waited = comm.traffic["wait_s"]
        step = _step(layer, x, grad, chunks, dist.barrier)
        return step, step - (comm.traffic["wait_s"] - waited)
    finally:
        comm.clear_link_model()


def cpu_task(shape: dict, chunks: int, rounds: int, comm_ratio: float, latency_ms: float) -> dict:
    """One EP rank on gloo. Each round times, back to back, serial and overlapped steps without
    and with the simulated link, so load changes on the shared machine hit all four alike; the
    round's plain serial step (its compute time: step minus transfer waits) sets the link."""
    import torch
    import torch.distributed as dist
    from titan_moe_ep_overlap import comm

    from titan_plugins.testing import plugin_active, tiny_gpt

    tiny_gpt.init_parallel(ep=2)
    with plugin_active("moe_ep_overlap", env=ENV):
        layer = _moe_layer(shape)
        gen = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(shape["tokens"], 1, shape["hidden"], generator=gen, requires_grad=True)
        grad = torch.randn(x.shape, generator=gen)
        for c in (1, chunks):  # warm-up: allocator, buffers, first-call paths
            _timed(layer, x, grad, c, None)
        before = comm.traffic["bytes"]
        _timed(layer, x, grad, 1, None)
        moved = float(comm.traffic["bytes"] - before)  # bytes one serial fwd+bwd moves
        modes = ("plain", "inject")
        times: dict = {(m, c): [] for m in modes for c in (1, chunks)}
        links = []
        for _ in range(rounds):
            # the plain serial step of this round calibrates the link: comm == ratio * compute
            step, compute = _timed(layer, x, grad, 1, None)
            compute_t = torch.tensor([compute])
            dist.all_reduce(compute_t, op=dist.ReduceOp.MAX)
            link = (comm_ratio * float(compute_t) / moved, latency_ms / 1e3)
            links.append(comm_ratio * float(compute_t))
            times[("plain", 1)].append((step, compute))
            times[("plain", chunks)].append(_timed(layer, x, grad, chunks, None))
            times[("inject", 1)].append(_timed(layer, x, grad, 1, link))
            times[("inject", chunks)].append(_timed(layer, x, grad, chunks, link))
    out = {}
    for mode in modes:
        serial = statistics.median(t for t, _ in times[(mode, 1)])
        overlap = statistics.median(t for t, _ in times[(mode, chunks)])
        out[mode] = {"serial_ms": 1e3 * serial, "overlap_ms": 1e3 * overlap,
                     "ratio": overlap / serial}  # fmt: skip
    out["inject"]["compute_ms"] = 1e3 * statistics.median(c for _, c in times[("plain", 1)])
    out["inject"]["injected_comm_ms"] = 1e3 * statistics.median(links)
    return out


def gpu_benchmark(shape: dict, chunks: int, rounds: int) -> dict | None:
    """CUDA/NCCL (DeepEP if compatible) comparison over all visible GPUs (>= 2), or None."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        print(f"gpu: skipped, needs >= 2 CUDA devices (found {count})")
        return None
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_gpu_worker, args=(count, shape, chunks, rounds, queue), nprocs=count)
    return queue.get()


def _gpu_worker(rank: int, world: int, shape: dict, chunks: int, rounds: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import titan_plugins

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    titan_plugins.apply(only=["moe_ep_overlap"])
    layer = _moe_layer({**shape, "tokens": shape["tokens"] * 8}, cpu=False).cuda()
    x = torch.randn(shape["tokens"] * 8, 1, shape["hidden"], device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    result = _compare(layer, x, grad, chunks, rounds, torch.cuda.synchronize)
    from titan_moe_ep_overlap.selection import select_backend

    result["backend"] = select_backend().detail
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def _print(name: str, row: dict) -> None:
    extra = ""
    if "injected_comm_ms" in row:
        extra = (f"  (serial compute in the rounds {row['compute_ms']:.1f} ms, "
                 f"link {row['injected_comm_ms']:.1f} ms)")  # fmt: skip
    print(f"{name:7s} serial {row['serial_ms']:8.1f} ms  overlapped {row['overlap_ms']:8.1f} ms"
          f"  ratio {row['ratio']:.3f}{extra}")  # fmt: skip


def main() -> None:
    """Parse arguments, run the sections, print medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=("plain", "inject", "gpu", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--comm-ratio", type=float, default=1.0, help="injected comm / compute")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="extra per all-to-all")
    args = parser.parse_args()
    shape = dict(tokens=args.tokens, hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                 topk=args.topk)  # fmt: skip
    print(f"MoE layer {shape}, EP=2, chunks={args.chunks}, {args.rounds} rounds (medians)")
    if args.section in ("plain", "inject", "all"):
        from titan_plugins.testing.workers import GlooWorkerPool

        with GlooWorkerPool(2) as pool:
            rows = pool.run(cpu_task, shape, args.chunks, args.rounds, args.comm_ratio,
                            args.latency_ms, timeout=1800)  # fmt: skip
        for rank, row in enumerate(rows):
            if args.section in ("plain", "all"):
                _print(f"plain r{rank}", row["plain"])
            if args.section in ("inject", "all"):
                _print(f"inject r{rank}", row["inject"])
        if args.section in ("inject", "all"):
            worst = max(row["inject"]["ratio"] for row in rows)
            print(f"goal overlapped/serial <= 0.75 with comm == compute: "
                  f"{'met' if worst <= 0.75 else 'NOT met'} ({worst:.3f})")  # fmt: skip
    if args.section in ("gpu", "all"):
        row = gpu_benchmark(shape, args.chunks, args.rounds)
        if row is not None:
            _print("gpu", row)
            print(f"gpu backend: {row['backend']}")


if __name__ == "__main__":
    main()
