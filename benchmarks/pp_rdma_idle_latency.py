"""pp_rdma's latency when cores sleep between messages, against gloo in the same run.

In a pipeline a rank waits for its neighbour (a bubble) and its cores go idle; the message that
ends the wait then runs on cold cores. ``benchmarks/pp_rdma.py`` sends messages back to back;
this one leaves ``--gap-ms`` of idle time before each round and reports, per size (median of
``--rounds``):

- landed: rank 0 posts a send, rank 1's receive completes (one way, from the sender's post);
- round trip: the same plus rank 1's one-element reply landing at rank 0.

gloo (torch.distributed isend / irecv) and pp_rdma (the Mooncake transport: 0 bytes travel
inline on the control connection, 256 KiB by a one-sided read) alternate round by round; the
ratio is gloo's time over pp_rdma's (> 1: pp_rdma faster). To compare two versions of pp_rdma,
run this script with ``PYTHONPATH`` pointing at the other checkout's ``plugins/pp_rdma``.

Usage: python benchmarks/pp_rdma_idle_latency.py [--sizes-kib 0 256] [--rounds 45] [--gap-ms 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import loadguard
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pp_rdma import begin, free_port  # the other pp_rdma benchmark, in this folder

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
WARMUP = 5


def _round(name: str, tr: Any, x: torch.Tensor, y: torch.Tensor, ack: torch.Tensor) -> tuple:
    """One message and its reply; returns (posted, landed, reply landed) as this rank saw them."""
    from titan_pp_rdma.wire import BWD, FWD

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    if rank == 0:
        posted = time.perf_counter()
        (dist.isend(x, peer) if name == "gloo" else tr.isend(x, peer, FWD)).wait()
        (dist.irecv(ack, peer) if name == "gloo" else tr.irecv(ack, peer, BWD)).wait()
        return posted, 0.0, time.perf_counter()
    (dist.irecv(y, peer) if name == "gloo" else tr.irecv(y, peer, FWD)).wait()
    landed = time.perf_counter()
    (dist.isend(ack, peer) if name == "gloo" else tr.isend(ack, peer, BWD)).wait()
    return 0.0, landed, 0.0


def _worker(rank: int, port: int, sizes: list[int], rounds: int, gap_s: float, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from titan_pp_rdma.session import open_session
    from titan_pp_rdma.settings import PPRdmaSettings

    tr = open_session(dist.group.WORLD, PPRdmaSettings(backend="mooncake", timeout_s=60)).transport
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for nbytes in sizes:
        x = torch.full((nbytes // 4,), float(rank))
        y, ack = torch.empty(nbytes // 4), torch.zeros(1)
        seen: dict[str, list[tuple]] = {"gloo": [], "pp_rdma": []}
        for i in range(rounds + WARMUP):
            for name in seen:
                dist.barrier()
                time.sleep(gap_s)  # both processes idle, as in a pipeline bubble
                marks = _round(name, tr, x, y, ack)
                if i >= WARMUP:
                    seen[name].append(marks)
        if rank == 1:
            assert y.eq(0.0).all(), "payload corrupted"
        for name, marks in seen.items():
            both: list[Any] = [None, None]
            dist.all_gather_object(both, marks)  # perf_counter: one clock for the whole host
            landed = [r1[1] - r0[0] for r0, r1 in zip(*both, strict=True)]
            trip = [r0[2] - r0[0] for r0 in both[0]]
            out[(name, nbytes)] = (statistics.median(landed), statistics.median(trip))
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--rounds", type=int, default=45)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    args = begin(parser)
    import titan_pp_rdma

    print(f"titan_pp_rdma from {os.path.dirname(titan_pp_rdma.__file__)}")
    sizes = [k << 10 for k in args.sizes_kib]
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker,
        args=(free_port(), sizes, args.rounds, args.gap_ms / 1e3, q),
        nprocs=2,
        start_method="spawn",
    )
    med = q.get()
    print(f"\n{args.gap_ms:g} ms idle before each round, median of {args.rounds} (us):")
    for nbytes in sizes:
        (gl, gt), (pl, pt) = med[("gloo", nbytes)], med[("pp_rdma", nbytes)]
        print(
            f"  {nbytes >> 10:6d} KiB  landed: gloo {gl * 1e6:6.0f}  pp_rdma {pl * 1e6:6.0f}  "
            f"({gl / pl:4.2f}x)   round trip: gloo {gt * 1e6:6.0f}  pp_rdma {pt * 1e6:6.0f}  "
            f"({gt / pt:4.2f}x)"
        )
    print("\n" + loadguard.describe(args) + "  (at the end)")


if __name__ == "__main__":
    main()
