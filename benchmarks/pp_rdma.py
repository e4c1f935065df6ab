"""Pipeline P2P over Mooncake Transfer Engine (plugin ``pp_rdma``) vs torch.distributed gloo.

Prints, each against gloo measured in the same run (ratio > 1: Mooncake faster; goal >= 1.0):
1. ping-pong on loopback: one message (256 KiB .. 64 MiB) and a one-element reply, GB/s;
2. streaming on loopback: ``--window`` messages posted together then waited (as the interleaved
   schedule posts its P2P under ``overlap_p2p_comm``), GB/s;
3. PP=2 x VPP=2 step time of the tiny MoE GPT through megatron-core's schedules
   (``overlap_p2p_comm``), plugin on (Mooncake) vs off (gloo), checked bit-identical;
4. on a CUDA machine only (``gpu_rdma_section``): device tensors over Mooncake (protocol auto,
   i.e. RDMA when a NIC is visible, ring buffers) vs NCCL send/recv. Needs the CUDA wheel
   ``mooncake-transfer-engine``.

Usage: python benchmarks/pp_rdma.py [--reps 7] [--window 4] [--skip-megatron] [--sizes-kib ...]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
SIZES_KIB = (256, 1024, 4096, 16384, 65536)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_round(x: torch.Tensor, y: torch.Tensor, ack: torch.Tensor, rank: int, window: int):
    peer = 1 - rank
    if rank == 0:
        works = [dist.isend(x[i], peer) for i in range(window)]
        for w in works:
            w.wait()
        dist.recv(ack, peer)
    else:
        works = [dist.irecv(y[i], peer) for i in range(window)]
        for w in works:
            w.wait()
        dist.send(ack, peer)


def _mooncake_round(tr: Any, x, y, ack, rank: int, window: int) -> None:
    from titan_pp_rdma.wire import BWD, FWD

    peer = 1 - rank
    if rank == 0:
        ops = [tr.isend(x[i], peer, FWD) for i in range(window)]
        for op in ops:
            op.wait()
        tr.irecv(ack, peer, BWD).wait()
    else:
        ops = [tr.irecv(y[i], peer, FWD) for i in range(window)]
        for op in ops:
            op.wait()
        tr.isend(ack, peer, BWD).wait()


def _loopback_worker(rank: int, port: int, sizes: list[int], reps: int, window: int, q: Any):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from titan_pp_rdma.session import open_session
    from titan_pp_rdma.settings import PPRdmaSettings

    session = open_session(dist.group.WORLD, PPRdmaSettings(backend="mooncake", timeout_s=60))
    tr = session.transport
    results: dict[tuple[str, int, int], list[float]] = {}
    for nbytes in sizes:
        for w in (1, window):
            x = torch.full((w, nbytes // 4), float(rank))
            y = torch.empty(w, nbytes // 4)
            ack = torch.zeros(1)
            for _ in range(reps + 1):  # alternate the two so drift hits both alike
                for name in ("gloo", "mooncake"):
                    dist.barrier()
                    start = time.perf_counter()
                    if name == "gloo":
                        _gloo_round(x, y, ack, rank, w)
                    else:
                        _mooncake_round(tr, x, y, ack, rank, w)
                    results.setdefault((name, nbytes, w), []).append(time.perf_counter() - start)
            if rank == 1:
                assert y.eq(0.0).all(), "payload corrupted"
    if rank == 0:
        q.put({k: statistics.median(v[1:]) for k, v in results.items()})
    dist.barrier()
    dist.destroy_process_group()


def loopback(sizes: list[int], reps: int, window: int) -> None:
    """Sections 1 and 2: ping-pong and streaming throughput, Mooncake TCP vs gloo."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(
        _loopback_worker,
        args=(_free_port(), sizes, reps, window, q),
        nprocs=2,
        start_method="spawn",
    )
    med = q.get()
    for title, w in (("ping-pong, 1 message", 1), (f"streaming, {window} in flight", window)):
        print(f"\n{title} (loopback, median of {reps}):")
        for nbytes in sizes:
            g, m = med[("gloo", nbytes, w)], med[("mooncake", nbytes, w)]
            gbs = [nbytes * w / t / 1e9 for t in (g, m)]
            print(
                f"  {nbytes >> 10:6d} KiB  gloo {gbs[0]:5.2f} GB/s  mooncake {gbs[1]:5.2f} GB/s"
                f"  ratio {g / m:5.2f}x"
            )


def step_task(env: dict | None, steps: int, hidden: int) -> dict:
    """One rank of the PP=2 x VPP=2 run: seconds per step and the losses."""
    import contextlib

    from titan_plugins.testing import plugin_active, tiny_gpt

    tiny_gpt.init_parallel(pp=2, vpp=2)
    active = plugin_active("pp_rdma", env=env) if env is not None else contextlib.nullcontext()
    with active:
        cfg = tiny_gpt.make_config(
            hidden_size=hidden,
            ffn_hidden_size=2 * hidden,
            overlap_p2p_comm=True,
            batch_p2p_comm=False,
            deallocate_pipeline_outputs=env is not None,  # unsafe on plain gloo
        )
        chunks = tiny_gpt.build_model(cfg, vpp=2)
        tiny_gpt.train(chunks, cfg, steps=1, num_microbatches=8)  # warm-up (buffers, handshake)
        start = time.perf_counter()
        losses, _ = tiny_gpt.train(chunks, cfg, steps=steps, num_microbatches=8)
        return {"s_per_step": (time.perf_counter() - start) / steps, "losses": losses}


def pp2_step_time(reps: int, hidden: int) -> None:
    """Section 3: tiny GPT PP=2 x VPP=2 step time, plugin (Mooncake) vs off (gloo)."""
    from titan_plugins.testing.workers import GlooWorkerPool

    runs = {
        "gloo (plugin off)": None,
        "mooncake": {"TITAN_PP_RDMA_BACKEND": "mooncake"},
        "torch fallback (plugin on)": {"TITAN_PP_RDMA_BACKEND": "torch"},
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list] = {}
    with GlooWorkerPool(2) as pool:
        for _ in range(reps):
            for name, env in runs.items():
                out = pool.run(step_task, env, 3, hidden, timeout=600)
                times[name].append(max(r["s_per_step"] for r in out))
                losses[name] = out[1]["losses"]
    base = statistics.median(times["gloo (plugin off)"])
    print(f"\nPP=2 x VPP=2 tiny GPT (hidden {hidden}, 8 microbatches), median of {reps}:")
    for name in runs:
        t = statistics.median(times[name])
        same = "same losses" if losses[name] == losses["gloo (plugin off)"] else "LOSSES DIFFER"
        print(f"  {name:28s} {t * 1e3:7.1f} ms/step  ratio {base / t:5.2f}x  ({same})")


def _gpu_worker(rank: int, port: int, sizes: list[int], reps: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=2)
    from titan_pp_rdma.session import open_session
    from titan_pp_rdma.settings import PPRdmaSettings

    settings = PPRdmaSettings(backend="mooncake", buffers="ring", timeout_s=60)
    tr = open_session(dist.group.WORLD, settings).transport
    out = {}
    for nbytes in sizes:
        x = torch.ones(1, nbytes // 2, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        ack = torch.zeros(1, device="cuda")
        for name in ("nccl", "mooncake"):
            ts = []
            for _ in range(reps + 1):
                dist.barrier()
                torch.cuda.synchronize()
                start = time.perf_counter()
                if name == "nccl":
                    _gloo_round(x, y, ack, rank, 1)  # same calls; the group is NCCL here
                else:
                    _mooncake_round(tr, x, y, ack, rank, 1)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - start)
            out[(name, nbytes)] = statistics.median(ts[1:])
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def gpu_rdma_section(sizes: list[int], reps: int) -> None:
    """Section 4 (CUDA only): device-tensor ping-pong, Mooncake (RDMA if present) vs NCCL."""
    if not torch.cuda.is_available():
        print("\nGPU/RDMA section: skipped (no CUDA device)")
        return
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _gpu_worker, args=(_free_port(), sizes, reps, q), nprocs=2, start_method="spawn"
    )
    med = q.get()
    print(f"\nGPU ping-pong (bf16 device tensors), median of {reps}:")
    for nbytes in sizes:
        n, m = med[("nccl", nbytes)], med[("mooncake", nbytes)]
        print(
            f"  {nbytes >> 10:6d} KiB  nccl {nbytes / n / 1e9:6.2f} GB/s  "
            f"mooncake {nbytes / m / 1e9:6.2f} GB/s  ratio {n / m:5.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=list(SIZES_KIB))
    parser.add_argument("--hidden", type=int, default=256, help="tiny GPT hidden size (PP=2 run)")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--skip-loopback", action="store_true")
    args = parser.parse_args()
    from titan_pp_rdma.probe import probe_mooncake

    probe = probe_mooncake()
    if not probe.available:
        raise SystemExit(f"Mooncake unavailable: {probe.detail}; fix: {probe.fix}")
    sizes = [k << 10 for k in args.sizes_kib]
    if not args.skip_loopback:
        loopback(sizes, args.reps, args.window)
    if not args.skip_megatron:
        pp2_step_time(max(1, args.reps // 2), args.hidden)
    gpu_rdma_section(sizes, args.reps)


if __name__ == "__main__":
    main()
