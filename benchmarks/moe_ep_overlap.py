"""MoE EP overlap (plugin ``moe_ep_overlap``): MoE layer forward+backward time with the chunked
dispatch/compute/combine pipeline versus megatron's serial flex path, both on the plugin's
torch.distributed backend, measured in the same run. Three ways to run the layer are timed in
alternating rounds (medians): ``serial`` (1 chunk: megatron's flex path), ``auto`` (what a user
gets: ``--chunks`` with the automatic serial-vs-pipeline choice, after its first trial window) and
``pipeline`` (``--chunks`` always, ``TITAN_MOE_EP_OVERLAP_AUTO=0``).

1. ``plain``: EP=2 on gloo over loopback (2 local processes). Nothing to hide: the "transfer" is
   a memcpy by gloo's thread on the same cores. Goal: auto / serial <= 1.02, loaded or not.
2. ``netns``: the two EP ranks in two network namespaces joined by a veth pair whose ends are
   rate-limited with ``tc`` tbf (``moe_ep_overlap_link.py``), gloo over that link. The rate is
   set from a serial step measured on the same link unlimited: the bytes one rank sends to the
   other per step over its compute time, so the all-to-all time equals the expert compute
   (``--comm-ratio``). Goal: pipeline / serial and auto / serial <= 0.75. Needs root and iproute2
   (``apt-get install iproute2``).
3. ``sleep-model``: a schedule check only, not a link: the completion of each transfer is delayed
   in the wait by a sleep computed from a serial-link model (same calibration). It shows the
   schedule keeps transfers in flight; it says nothing about a network.
4. ``gpu``: ``gpu_benchmark()`` - CUDA with NCCL (DeepEP if a compatible v1 is installed), one
   process per GPU (one GPU: two processes share it, over gloo). ``--section gpu --gpu-smoke``
   runs it tiny on CPU (``scripts/gpu_check.sh --dry-run``).

    .venv/bin/python benchmarks/moe_ep_overlap.py [--section plain|netns|sleep-model|gpu|all]
        [--rounds 15] [--force]

Ratios are medians of per-round ratios (a round runs the three modes back to back, in rotating
order); the ratio of the medians follows in brackets. Prints the load average first and last;
verdicts are withheld above the load threshold (``loadguard``) unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

ENV = {"TITAN_MOE_EP_OVERLAP_BACKEND": "torch"}
MODES = ("serial", "auto", "pipeline")
LINK_PORT = 29561


def _moe_layer(shape: dict, cpu: bool = True) -> Any:
    """A megatron MoELayer (flex dispatcher, DeepEP backend name) of the given shape."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
        num_attention_heads=8, num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
        moe_token_dispatcher_type="flex", moe_router_dtype="fp32", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        use_cpu_initialization=cpu, add_bias_linear=False, hidden_dropout=0.0,
        bf16=not cpu, params_dtype=torch.float32 if cpu else torch.bfloat16,
    )  # fmt: skip
    mlp = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts).submodules.mlp
    # From 0.18 the MoE submodule is a functools.partial building the layer, not a ModuleSpec.
    return build_module(mlp, config=cfg) if isinstance(mlp, ModuleSpec) else mlp(config=cfg)


def _inputs(shape: dict, rank: int) -> tuple:
    import torch

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(shape["tokens"], 1, shape["hidden"], generator=gen, requires_grad=True)
    return x, torch.randn(x.shape, generator=gen)


def _step(layer: Any, x: Any, grad: Any, mode: str, chunks: int, sync: Any) -> float:
    """One timed fwd+bwd of the layer in ``mode`` (serial / auto / pipeline)."""
    import torch

    os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = "1" if mode == "serial" else str(chunks)
    os.environ["TITAN_MOE_EP_OVERLAP_AUTO"] = "1" if mode == "auto" else "0"
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


def measure(layer: Any, x: Any, grad: Any, chunks: int, rounds: int, sync: Any) -> dict:
    """Medians of serial / auto / pipeline steps in rotating order, ratios and auto's choice.

    Before timing: one warm-up step per mode, then auto's first trial window (it alternates both
    paths), so ``auto`` is timed in its steady state; each later window costs at most
    ``TRIALS`` calls of the slower path per steady period (32 -> 1024 calls).
    """
    from titan_moe_ep_overlap import autochunk, comm, stats

    for mode in MODES:
        _step(layer, x, grad, mode, chunks, sync)
    for _ in range(2 * (autochunk.WARMUP + autochunk.TRIALS)):
        _step(layer, x, grad, "auto", chunks, sync)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    exposed: dict[str, list[float]] = {mode: [] for mode in MODES}  # host waits for transfers
    auto_paths = {"pipelined_calls": 0, "serial_calls": 0}
    for index in range(rounds):
        # rotate the order so no mode always runs right after the same other one
        for mode in MODES[index % 3 :] + MODES[: index % 3]:
            waited, before = comm.traffic["wait_s"], stats.counts()
            times[mode].append(_step(layer, x, grad, mode, chunks, sync))
            exposed[mode].append(comm.traffic["wait_s"] - waited)
            if mode == "auto":  # which path auto's timed steps took
                for key in ("pipelined_calls", "serial_calls"):
                    auto_paths[key] += stats.counts()[key] - before[key]
    out: dict[str, Any] = {f"{m}_ms": 1e3 * statistics.median(times[m]) for m in MODES}
    for mode in ("auto", "pipeline"):
        # the steps of one round ran back to back under the same load: the median of their
        # ratios is the figure (a load spike hits a round's steps alike); the ratio of the
        # medians is printed beside it
        out[f"{mode}_ratio"] = statistics.median(
            a / b for a, b in zip(times[mode], times["serial"])
        )
        out[f"{mode}_ratio_of_medians"] = out[f"{mode}_ms"] / out["serial_ms"]
    for mode in MODES:
        out[f"{mode}_wait_ms"] = 1e3 * statistics.median(exposed[mode])
    out["rounds_ms"] = {m: [round(1e3 * t, 1) for t in times[m]] for m in MODES}
    out["auto_choice"] = {True: "pipeline", False: "serial", None: "none"}[autochunk.choice(layer)]
    out["auto_decisions"] = stats.snapshot()["auto_decisions"]
    out["auto_paths"] = auto_paths
    return out


def plain_task(shape: dict, chunks: int, rounds: int) -> dict:
    """One EP rank on gloo over loopback (a GlooWorkerPool task)."""
    import torch.distributed as dist

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=2)
    with plugin_active("moe_ep_overlap", env=ENV):
        layer = _moe_layer(shape)
        x, grad = _inputs(shape, dist.get_rank())
        return measure(layer, x, grad, chunks, rounds, dist.barrier)


# ------------------------------------------------------------------ netns: a real limited link
def _tx_bytes() -> int:
    """Bytes this namespace's veth end has sent (TCP/IP headers and every collective included)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as counter:
            return int(counter.read())
    except (OSError, ValueError):
        return 0


def calibrate(layer: Any, x: Any, grad: Any, steps: int = 3) -> dict:
    """What a serial step does on the current link: compute seconds (step minus host waits, max
    over the ranks), bytes to the peer (the plugin's all-to-all payload, and all the veth sent),
    and the transfer time (the host waits of the rank that waited least: the other rank's waits
    also hold the time it waited for its peer to arrive)."""
    import torch
    import torch.distributed as dist
    from titan_moe_ep_overlap import comm

    computes, waits, payload, wire = [], [], [], []
    for _ in range(steps):
        waited, before, tx = comm.traffic["wait_s"], comm.traffic["remote_bytes"], _tx_bytes()
        step = _step(layer, x, grad, "serial", 1, dist.barrier)
        waits.append(comm.traffic["wait_s"] - waited)
        computes.append(step - waits[-1])
        payload.append(comm.traffic["remote_bytes"] - before)
        wire.append(_tx_bytes() - tx)
    values = [statistics.median(computes), -statistics.median(waits), max(payload), max(wire)]
    reduced = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    compute, comm_s, payload_bytes, wire_bytes = reduced.tolist()
    return {"compute_s": compute, "comm_s": -comm_s, "payload_bytes": payload_bytes,
            "wire_bytes": wire_bytes}  # fmt: skip


def link_worker(args: argparse.Namespace) -> None:
    """One EP rank inside its namespace: calibrate, ask the parent to set the rate, measure."""
    import torch

    torch.set_num_threads(1)
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()
    import megatron.core  # noqa: F401
    import torch.distributed as dist

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    rank = args.link_worker
    # a bounded timeout: if the parent dies the peer must not wait gloo's default 30 minutes
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{LINK_PORT}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=600))  # fmt: skip
    tiny_gpt.init_parallel(ep=2)
    with plugin_active("moe_ep_overlap", env=ENV):
        shape = _shape(args)
        layer = _moe_layer(shape)
        x, grad = _inputs(shape, rank)
        for mode in MODES:
            _step(layer, x, grad, mode, args.chunks, dist.barrier)
        calibration = calibrate(layer, x, grad)
        while True:  # the parent sets (and corrects) the rate until comm ~ compute, then "GO"
            command = torch.zeros(1)
            if rank == 0:
                print("CALIBRATION " + json.dumps(calibration), flush=True)
                command[0] = float(sys.stdin.readline().strip() == "GO")
            dist.broadcast(command, 0)
            if command[0]:
                break
            calibration = calibrate(layer, x, grad)
        result = measure(layer, x, grad, args.chunks, args.rounds, dist.barrier)
        result["compute_ms"] = 1e3 * calibration["compute_s"]
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_netns(args: argparse.Namespace) -> list[dict] | None:
    """Both ranks in their namespaces over a tbf-limited veth; returns their results."""
    import moe_ep_overlap_link as netlink

    from titan_plugins.testing.workers import WORKER_ENV

    problem = netlink.missing_tools()
    if problem:
        print(f"netns: skipped, {problem}")
        return None
    script = os.path.abspath(__file__)
    with netlink.link() as link, tempfile.TemporaryDirectory() as logs:
        procs = []
        for rank in (0, 1):
            env = {**os.environ, **WORKER_ENV, "GLOO_SOCKET_IFNAME": link.ends[rank][1]}
            command = [*link.prefix(rank), sys.executable, script, "--link-worker", str(rank),
                       "--master", link.ends[0][2], *_shape_args(args)]  # fmt: skip
            log = open(os.path.join(logs, f"rank{rank}.log"), "w")  # noqa: SIM115
            procs.append(subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stderr=log,
                                          stdout=subprocess.PIPE, text=True))  # fmt: skip
        try:
            set_rate(procs[0], link, args.comm_ratio, logs)
            results = [_read_tagged(p, "RESULT", logs) for p in procs]
            for proc in procs:
                proc.wait(timeout=120)
            return results
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def set_rate(rank0: subprocess.Popen, link: Any, comm_ratio: float, logs: str) -> None:
    """Rate the link so a serial step's all-to-all time is ``comm_ratio`` x its compute.

    First from bytes / compute (unlimited link), then corrected from the transfer time measured
    on the limited link (TCP over a token bucket does not reach the bucket's rate when both
    directions are busy: each side's ACKs queue behind its own data), at most 4 times.
    """
    calibration = _read_tagged(rank0, "CALIBRATION", logs)
    sent = calibration["wire_bytes"] or calibration["payload_bytes"]  # headers and all, if read
    print(f"netns: serial compute {1e3 * calibration['compute_s']:.0f} ms, "
          f"{sent / 2**20:.1f} MiB sent to the peer per step (all-to-all payload "
          f"{calibration['payload_bytes'] / 2**20:.1f} MiB), unlimited transfer time "
          f"{1e3 * calibration['comm_s']:.0f} ms")  # fmt: skip
    rate = sent / (comm_ratio * calibration["compute_s"])
    for _ in range(4):
        shown = link.limit(rate)
        rank0.stdin.write("MEASURE\n")
        rank0.stdin.flush()
        calibration = _read_tagged(rank0, "CALIBRATION", logs)
        target = comm_ratio * calibration["compute_s"]
        print(f"netns: {shown} -> transfer {1e3 * calibration['comm_s']:.0f} ms per serial "
              f"step, compute {1e3 * calibration['compute_s']:.0f} ms")  # fmt: skip
        if abs(calibration["comm_s"] / target - 1.0) <= 0.15:
            break
        rate *= calibration["comm_s"] / target
    rank0.stdin.write("GO\n")
    rank0.stdin.flush()


def _read_tagged(proc: subprocess.Popen, tag: str, logs: str) -> dict:
    for line in proc.stdout:
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    tails = "".join(open(os.path.join(logs, f)).read()[-3000:] for f in sorted(os.listdir(logs)))
    raise RuntimeError(f"a link worker exited before {tag} (rc {proc.wait()}):\n{tails}")


# ------------------------------------------------------------------ sleep model (schedule only)
def sleep_model_task(shape: dict, chunks: int, rounds: int, comm_ratio: float) -> dict:
    """Schedule check: each transfer's completion is delayed in its wait by a serial-link model
    whose bandwidth makes the layer's all-to-all time ``comm_ratio`` x its serial compute."""
    import torch
    import torch.distributed as dist
    from titan_moe_ep_overlap import comm

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=2)
    with plugin_active("moe_ep_overlap", env=ENV):
        layer = _moe_layer(shape)
        x, grad = _inputs(shape, dist.get_rank())
        for mode in ("serial", "pipeline"):
            _step(layer, x, grad, mode, chunks, dist.barrier)
        times: dict[str, list[float]] = {"serial": [], "pipeline": []}
        for _ in range(rounds):
            before, waited = comm.traffic["bytes"], comm.traffic["wait_s"]
            step = _step(layer, x, grad, "serial", chunks, dist.barrier)  # calibrates the model
            compute = torch.tensor([step - (comm.traffic["wait_s"] - waited)])
            dist.all_reduce(compute, op=dist.ReduceOp.MAX)
            per_byte = comm_ratio * float(compute) / (comm.traffic["bytes"] - before)
            for mode in ("serial", "pipeline"):
                comm.set_link_model(per_byte)
                try:
                    times[mode].append(_step(layer, x, grad, mode, chunks, dist.barrier))
                finally:
                    comm.clear_link_model()
    serial, pipelined = (statistics.median(times[m]) for m in ("serial", "pipeline"))
    return {"serial_ms": 1e3 * serial, "pipeline_ms": 1e3 * pipelined,
            "pipeline_ratio": pipelined / serial}  # fmt: skip


# ------------------------------------------------------------------ GPU
def gpu_benchmark(shape: dict, chunks: int, rounds: int) -> dict | None:
    """CUDA/NCCL (DeepEP if compatible) comparison over all visible GPUs (>= 2), or None."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        print("gpu: skipped, no CUDA device")
        return None
    import torch.multiprocessing as mp

    # One GPU: two EP ranks share it over gloo (NCCL refuses two ranks on one device; gloo's
    # all-to-all stages CUDA tensors through host memory), so the schedule is still measured.
    world = max(2, count)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_gpu_worker, args=(world, shape, chunks, rounds, queue), nprocs=world)
    return queue.get()


def _gpu_worker(rank: int, world: int, shape: dict, chunks: int, rounds: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import titan_plugins

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    count = torch.cuda.device_count()
    torch.cuda.set_device(rank % count)
    dist.init_process_group("nccl" if count >= world else "gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    titan_plugins.apply(only=["moe_ep_overlap"])
    layer = _moe_layer({**shape, "tokens": shape["tokens"] * 8}, cpu=False).cuda()
    x = torch.randn(shape["tokens"] * 8, 1, shape["hidden"], device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    result = measure(layer, x, torch.randn_like(x), chunks, rounds, torch.cuda.synchronize)
    from titan_moe_ep_overlap.selection import select_backend

    result["backend"] = select_backend().detail + f" ({dist.get_backend()}, {count} GPU)"
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def gpu_section(args: argparse.Namespace) -> None:
    """``--section gpu`` (``scripts/gpu_check.sh``): the GPU comparison, its figures emitted.

    On one GPU the two EP ranks share it over gloo. ``--gpu-smoke`` runs the same measurement
    tiny on CPU (EP=2 on gloo).
    """
    import gpu_check

    if args.gpu_smoke:
        from titan_plugins.testing.workers import GlooWorkerPool

        shape = dict(tokens=256, hidden=64, ffn=128, experts=4, topk=2)
        with GlooWorkerPool(2) as pool:
            rows = pool.run(plain_task, shape, 2, 3, timeout=600)
        row = rows[0]
        _print("gpu-smoke r0", row)
    else:
        row = gpu_benchmark(_shape(args), args.chunks, args.rounds)
        if row is None:
            gpu_check.emit({"skipped": "no CUDA device"})
            return
        _print("gpu", row)
    keys = ("serial_ms", "auto_ms", "pipeline_ms", "auto_ratio", "pipeline_ratio", "auto_choice")
    gpu_check.emit({key: row[key] for key in keys} | {"backend": row.get("backend", "torch")})


# ------------------------------------------------------------------ command line
def _shape(args: argparse.Namespace) -> dict:
    return dict(tokens=args.tokens, hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                topk=args.topk)  # fmt: skip


def _shape_args(args: argparse.Namespace) -> list[str]:
    names = ("tokens", "hidden", "ffn", "experts", "topk", "chunks", "rounds")
    return [item for name in names for item in (f"--{name}", str(getattr(args, name)))]


def _print(name: str, row: dict) -> None:
    print(f"{name:13s} serial {row['serial_ms']:7.1f} ms  auto {row['auto_ms']:7.1f} ms "
          f"(chose {row['auto_choice']})  pipeline {row['pipeline_ms']:7.1f} ms  "
          f"auto/serial {row['auto_ratio']:.3f} ({row['auto_ratio_of_medians']:.3f})  "
          f"pipeline/serial {row['pipeline_ratio']:.3f} ({row['pipeline_ratio_of_medians']:.3f})"
          f"  waited: serial {row['serial_wait_ms']:.0f} ms, pipeline "
          f"{row['pipeline_wait_ms']:.0f} ms")  # fmt: skip
    if os.environ.get("MOE_BENCH_VERBOSE"):
        print(f"{'':13s} per round (ms): {row['rounds_ms']}; auto's steps: {row['auto_paths']}")


def _parser() -> argparse.ArgumentParser:
    import loadguard

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", default="all",
                        choices=("plain", "netns", "sleep-model", "gpu", "all"))  # fmt: skip
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--comm-ratio", type=float, default=1.0,
                        help="all-to-all time / expert compute on the limited link")  # fmt: skip
    parser.add_argument("--gpu-smoke", action="store_true",
                        help="--section gpu tiny on CPU (EP=2 on gloo; scripts/gpu_check.sh)")  # fmt: skip
    parser.add_argument("--link-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--master", default=None, help=argparse.SUPPRESS)
    loadguard.add_arguments(parser)
    return parser


def main() -> None:
    """Parse arguments, run the sections, print medians, ratios and verdicts."""
    import loadguard

    args = _parser().parse_args()
    if args.link_worker is not None:
        link_worker(args)
        return
    if args.section == "gpu":
        gpu_section(args)
        return
    shape, wanted = _shape(args), {args.section}
    if args.section == "all":
        wanted = {"plain", "netns", "sleep-model", "gpu"}
    print(f"MoE layer {shape}, EP=2, chunks={args.chunks}, {args.rounds} rounds (medians)")
    print(loadguard.describe(args))
    if wanted & {"plain", "sleep-model"}:
        from titan_plugins.testing.workers import GlooWorkerPool

        with GlooWorkerPool(2) as pool:
            if "plain" in wanted:
                rows = pool.run(plain_task, shape, args.chunks, args.rounds, timeout=1800)
                for rank, row in enumerate(rows):
                    _print(f"plain r{rank}", row)
                worst = max(row["auto_ratio"] for row in rows)
                print(f"goal on loopback auto/serial <= 1.02: "
                      f"{loadguard.verdict(worst <= 1.02, args)} ({worst:.3f})")  # fmt: skip
            if "sleep-model" in wanted:
                rows = pool.run(sleep_model_task, shape, args.chunks, args.rounds,
                                args.comm_ratio, timeout=1800)  # fmt: skip
                for rank, row in enumerate(rows):
                    print(f"sleep-model r{rank} (schedule check only, not a link): serial "
                          f"{row['serial_ms']:.1f} ms  pipeline {row['pipeline_ms']:.1f} ms  "
                          f"ratio {row['pipeline_ratio']:.3f}")  # fmt: skip
    if "netns" in wanted:
        rows = run_netns(args)
        if rows is not None:
            for rank, row in enumerate(rows):
                _print(f"netns r{rank}", row)
            worst = max(max(row["auto_ratio"], row["pipeline_ratio"]) for row in rows)
            print(f"goal on the limited link pipeline/serial and auto/serial <= 0.75: "
                  f"{loadguard.verdict(worst <= 0.75, args)} ({worst:.3f})")  # fmt: skip
    print(loadguard.describe(args))
    if "gpu" in wanted:
        row = gpu_benchmark(shape, args.chunks, args.rounds)
        if row is not None:
            _print("gpu", row)
            print(f"gpu backend: {row['backend']}")


if __name__ == "__main__":
    main()
