"""Pipeline P2P over Mooncake Transfer Engine (plugin ``pp_rdma``) vs torch.distributed gloo.

Prints, each against gloo measured in the same run (ratio > 1: pp_rdma faster; goal >= 1.0 from
256 KiB to 64 MiB and for the PP=2 x VPP=2 step):
1. one way on loopback: one message, from posting to landed (the receiver's completion; the
   initiator's for a raw write, whose completion Mooncake reports once applied at the peer), for
   gloo, pp_rdma, and Mooncake's own raw read and write of the same bytes between the same
   processes (no control messages: the ceiling any protocol over Mooncake's TCP transport
   reaches);
2. ping-pong: one message and a one-element reply (the issue's metric), with two bounds set by
   Mooncake itself: a raw read of the message plus a raw read of one element, no signalling
   (what no protocol over Mooncake's TCP transport can beat), and a raw read of the message plus
   a gloo round trip of one element, or the same with a raw write (a protocol whose two signals
   - "the bytes are at this address" or "the bytes are in your buffer", and the reply - cost no
   more than gloo's own smallest message: a receiver cannot read before it learns where and
   when, nor use written bytes before it learns they landed). Both bounds are measured in the
   same rounds as the ping-pong (alternating), and hold for one Mooncake transfer per message
   (pp_rdma splits reads of 8 MiB and more into concurrent slices, which can beat them). Where
   even the second bound is below gloo, the verdict says so and how near pp_rdma comes to it;
   and streaming:
   ``--window`` messages posted together then waited (as the interleaved schedule posts its P2P
   under ``overlap_p2p_comm``);
3. where pp_rdma's time goes, per phase (``titan_pp_rdma.stats``), in extra ping-pong rounds,
   and (3b) where the CPU of a round goes, by thread (training thread, pp_rdma's helper, gloo's
   threads, Mooncake's engine threads), gloo's rounds beside pp_rdma's;
4. PP=2 x VPP=2 step time of the tiny MoE GPT through megatron-core's schedules
   (``overlap_p2p_comm``), plugin on (Mooncake) vs off (gloo), checked for identical losses,
   ``--reps`` reps in alternating order, each variant's ratio paired with the gloo run of its
   own rep (median and quartiles);
5. on a CUDA machine only (``gpu_section``, alone with ``--section gpu``): device tensors over
   Mooncake (protocol auto, i.e. RDMA when a NIC is visible, ring buffers) vs NCCL send/recv
   (two GPUs) or gloo through host memory (one GPU shared by both ranks); ``--gpu-smoke`` runs
   it tiny on CPU (``scripts/gpu_check.sh --dry-run``).

``--runs N`` repeats sections 1-3 in N fresh process pairs and pools the ping-pong: the median
over runs of each run's ratio and cap, the 95% interval of each median, and a verdict on that
(``pooled_verdict``: a cap is shown only when its whole interval lies below 1.0; 5 runs or
more).

Every time is the median of ``--reps`` rounds; each round starts after a barrier and runs from
the later rank's start to the later rank's end (``perf_counter`` is one clock for every process
of a host). Section 2 also gives the CPU time a round costs both processes (every thread,
``getrusage``): on a machine whose cores are shared, it is what the wall time follows. Prints
the load average first; verdicts are withheld on a loaded machine (see ``loadguard``) unless
``--force``.

Usage: [TITAN_PP_RDMA_*=...] python benchmarks/pp_rdma.py [--reps 9] [--runs 1] [--window 4]
           [--skip-megatron] [--sizes-kib ...]   (the knobs apply to sections 1-3, except backend and timeout)
       python benchmarks/pp_rdma.py --section gpu [--gpu-smoke]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import loadguard
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from intervals import median_interval

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
SIZES_KIB = (256, 1024, 4096, 16384, 65536)
ONE_WAY = ("gloo", "pp_rdma", "raw read", "raw write")
BOUNDS = ("gloo signal", "raw read", "raw write", "raw tiny")  # measured with each ping-pong
CONFIDENCE = 0.95  # of the pooled ping-pong's intervals
MIN_COVERAGE = 0.9  # an interval that covers the median less often shows no cap
STEPS = 3  # timed training steps per run of section 4 (after one warm-up step)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu() -> float:
    """CPU seconds this process used so far, all threads (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _span(t0: float, t1: float, end_rank: int | None = None, alone: bool = False) -> float:
    """Later start to later end over both ranks (one monotonic clock per host), or to
    ``end_rank``'s end (the rank that knows the bytes landed); ``alone``: ``end_rank``'s own
    start (an operation only that rank takes part in, e.g. a raw write: the passive rank may
    start after it ended)."""
    both = torch.tensor([t0, t1], dtype=torch.float64)
    gathered = [torch.empty_like(both) for _ in range(2)]
    dist.all_gather(gathered, both)
    ends = [g[1].item() for g in gathered]
    end = max(ends) if end_rank is None else ends[end_rank]
    if alone and end_rank is not None:
        return end - gathered[end_rank][0].item()
    return end - max(g[0].item() for g in gathered)


def begin(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the arguments (with the load guard's), print the load and the command line, and
    stop with the probe's fix unless Mooncake can run here."""
    loadguard.add_arguments(parser)
    args = parser.parse_args()
    print(loadguard.describe(args))
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    from titan_pp_rdma.probe import probe_mooncake

    probe = probe_mooncake()
    if not probe.available:
        raise SystemExit(f"Mooncake unavailable: {probe.detail}; fix: {probe.fix}")
    return args


class Raw:
    """Mooncake's own async read / sync write between the two ranks' registered buffers."""

    def __init__(self, engine: Any, nbytes: int) -> None:
        self.te = engine._te
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        engine.register(self.buf)
        mine = (engine.session_id, self.buf.data_ptr())
        both: list[Any] = [None, None]
        dist.all_gather_object(both, mine)
        self.peer = both[1 - dist.get_rank()]

    def read(self, nbytes: int) -> None:
        """Pull ``nbytes`` from the peer, polled like the transport polls (10-100 us naps)."""
        bid = self.te.batch_transfer_async_read(
            self.peer[0], [self.buf.data_ptr()], [self.peer[1]], [nbytes]
        )
        nap = 1e-5
        while (state := self.te.transfer_check_status(bid)) == 0:
            time.sleep(nap)
            nap = min(2 * nap, 1e-4)
        assert state == 1, state

    def write(self, nbytes: int) -> None:
        """Push ``nbytes`` (Mooncake's sync call; completes once applied at the peer)."""
        rc = self.te.transfer_sync_write(self.peer[0], self.buf.data_ptr(), self.peer[1], nbytes)
        assert rc == 0, rc


def _one_way(name: str, tr: Any, raw: Raw, x: torch.Tensor, y: torch.Tensor) -> None:
    """Rank 0's ``x`` lands in rank 1's ``y`` (raw: rank 1 reads / rank 0 writes)."""
    from titan_pp_rdma.wire import FWD

    rank = dist.get_rank()
    if name == "gloo":
        (dist.isend(x, 1) if rank == 0 else dist.irecv(y, 0)).wait()
    elif name == "pp_rdma":
        (tr.isend(x, 1, FWD) if rank == 0 else tr.irecv(y, 0, FWD)).wait()
    elif name == "raw read" and rank == 1:
        raw.read(x.numel() * x.element_size())
    elif name == "raw write" and rank == 0:
        raw.write(x.numel() * x.element_size())


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
    from titan_pp_rdma.session import STATE, open_session
    from titan_pp_rdma.settings import PPRdmaSettings

    try:
        from titan_pp_rdma.stats import PhaseStats
    except ImportError:  # an older pp_rdma (A/B runs against main): no phase timers
        PhaseStats = None

    # The TITAN_PP_RDMA_* knobs apply (e.g. TITAN_PP_RDMA_INLINE_BYTES=1M sends every size up to
    # 1 MiB inline), except the backend and the timeout, which the benchmark needs.
    settings = PPRdmaSettings.from_env()._replace(backend="mooncake", timeout_s=60)
    session = open_session(dist.group.WORLD, settings)
    tr = session.transport
    raw = Raw(STATE.engine, max(sizes))
    times: dict[tuple[str, int, int], list[float]] = {}
    phases: dict[int, list[dict]] = {}
    threads: dict[int, list[dict]] = {}
    tiny = torch.zeros(1)
    signal = torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1)
    for nbytes in sizes:
        x1, y1 = torch.full((nbytes // 4,), float(rank)), torch.empty(nbytes // 4)
        for _ in range(reps + 1):  # alternate the variants so drift hits all alike
            for name in ONE_WAY:
                dist.barrier()
                t0 = time.perf_counter()
                _one_way(name, tr, raw, x1, y1)
                lander = 0 if name == "raw write" else 1  # whose completion means "landed"
                span = _span(t0, time.perf_counter(), lander, alone=name == "raw write")
                times.setdefault((name, nbytes, 0), []).append(span)
        for w in (1, window):
            x = torch.full((w, nbytes // 4), float(rank))
            y = torch.empty(w, nbytes // 4)
            ack = torch.zeros(1)
            # The ping-pong's bounds are measured in the same rounds as the ping-pong itself, so
            # the machine's drift between phases of the run hits them alike.
            bounds = BOUNDS if w == 1 else ()
            for _ in range(reps + 1):
                for name in ("gloo", "pp_rdma", *bounds):
                    dist.barrier()
                    c0, t0 = _cpu(), time.perf_counter()
                    if name == "gloo":
                        _gloo_round(x, y, ack, rank, w)
                    elif name == "pp_rdma":
                        _mooncake_round(tr, x, y, ack, rank, w)
                    elif name == "gloo signal":  # one element there and back: two signals
                        _gloo_round(*signal, rank, 1)
                    elif name == "raw tiny":  # the least a reply through Mooncake costs
                        _one_way("raw read", tr, raw, tiny, tiny)
                    else:
                        _one_way(name, tr, raw, x1, y1)
                    t1, c1 = time.perf_counter(), _cpu()
                    if name in ("gloo", "pp_rdma", "gloo signal"):
                        span = _span(t0, t1)
                    else:  # a raw op: to the end of the rank that knows the bytes landed
                        lander = 0 if name == "raw write" else 1
                        span = _span(t0, t1, lander, alone=name == "raw write")
                    times.setdefault((name, nbytes, w), []).append(span)
                    if name not in bounds:
                        cpu = torch.tensor([c1 - c0], dtype=torch.float64)
                        dist.all_reduce(cpu)  # both processes, every thread (gloo's, Mooncake's)
                        times.setdefault((name + " cpu", nbytes, w), []).append(cpu.item())
            if rank == 1:
                assert y.eq(0.0).all(), "payload corrupted"
        one = x1.view(1, -1), y1.view(1, -1), torch.zeros(1)
        mine = {
            "gloo": _cpu_by_thread(3 * reps, _gloo_round, *one, rank, 1),
            "pp_rdma": _cpu_by_thread(3 * reps, _mooncake_round, tr, *one, rank, 1),
        }
        both = [None, None]
        dist.all_gather_object(both, mine)
        threads[nbytes] = both
        if PhaseStats is None:
            continue
        tr.stats = PhaseStats()  # extra rounds, so the timers never slow the timed ones
        for _ in range(reps):
            dist.barrier()
            _mooncake_round(tr, x1.view(1, -1), y1.view(1, -1), torch.zeros(1), rank, 1)
        dist.barrier()
        tr.stats, stats = None, tr.stats
        both: list[Any] = [None, None]
        dist.all_gather_object(both, stats.summary())
        phases[nbytes] = both
    if rank == 0:
        q.put(({k: statistics.median(v[1:]) for k, v in times.items()}, phases, threads))
    dist.barrier()
    dist.destroy_process_group()


def _loopback_run(sizes: list[int], reps: int, window: int) -> tuple[dict, dict, dict]:
    """One fresh pair of processes through sections 1-3: the medians, the phase timers and the
    CPU by thread."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(
        _loopback_worker,
        args=(free_port(), sizes, reps, window, q),
        nprocs=2,
        start_method="spawn",
    )
    return q.get()


def loopback(sizes: list[int], reps: int, window: int, args: argparse.Namespace) -> None:
    """Sections 1-3 (``--runs`` times, each in a fresh pair of processes, then pooled)."""
    pooled: dict[int, list[tuple[float, float]]] = {nbytes: [] for nbytes in sizes}
    for run in range(args.runs):
        if args.runs > 1:
            print(f"\n--- run {run + 1} of {args.runs} (fresh processes) ---")
        med, phases, threads = _loopback_run(sizes, reps, window)
        for nbytes, ratios in _print_run(med, sizes, reps, window, args).items():
            pooled[nbytes].append(ratios)
    if args.runs > 1:
        _print_pooled(pooled, args)
    _print_phases(phases, sizes)  # the last run's
    _print_threads(threads, sizes)


def _print_pooled(pooled: dict[int, list[tuple[float, float]]], args: argparse.Namespace) -> None:
    """Ping-pong over every run: each run's ratio and cap (paired within its run), pooled.

    Within a run gloo, pp_rdma and the bounds alternate round by round in the same processes;
    between runs gloo's own ping-pong moved by up to 2x (4 MiB: 0.97-2.03 GB/s over six runs on
    2026-12-02). So the pooled verdict is the median over runs of ratios measured within a run.
    """
    print(
        f"\n   ping-pong over {args.runs} runs, median of the per-run ratios "
        f"[{CONFIDENCE:.0%} interval of the median, or the whole range when fewer runs]:"
    )
    for nbytes, runs in pooled.items():
        ratios, caps = [r for r, _ in runs], [c for _, c in runs]
        ratio, cap = statistics.median(ratios), statistics.median(caps)
        r_low, r_high, _ = median_interval(ratios, CONFIDENCE)
        c_low, c_high, _ = median_interval(caps, CONFIDENCE)
        share = statistics.median(r / c for r, c in runs)
        print(
            f"  {nbytes >> 10:6d} KiB  pp_rdma {ratio:4.2f}x [{r_low:4.2f}-{r_high:4.2f}]"
            f"  cap {cap:4.2f}x [{c_low:4.2f}-{c_high:4.2f}]  pp_rdma / cap {share:.0%}  "
            + pooled_verdict(runs, args)
        )


def pooled_verdict(runs: list[tuple[float, float]], args: argparse.Namespace | None) -> str:
    """The ping-pong goal judged over runs: each run's (pp_rdma / gloo, cap / gloo).

    Met when the median ratio is at least 1.0. Otherwise the cap is shown only when the whole
    interval of its median lies below 1.0: a median cap below 1.0 whose interval reaches 1.0
    (one run's cap at 16 MiB ranged over 0.60-1.33 in 31 runs on the 2-core VM) does not show
    that Mooncake's transport is what stops pp_rdma, and neither do too few runs for a
    ``CONFIDENCE`` interval (fewer than 6 give the whole range, at a lower coverage).
    """
    ratios, caps = [r for r, _ in runs], [c for _, c in runs]
    if statistics.median(ratios) >= 1.0:
        return loadguard.verdict(True, args)
    low, high, coverage = median_interval(caps, CONFIDENCE)
    if coverage < MIN_COVERAGE:
        why = (
            f"NOT met; {len(runs)} runs cannot show a cap (their range covers the median "
            f"{coverage:.0%}): use --runs 5 or more"
        )
    elif high < 1.0:
        why = (
            f"NOT met: capped, Mooncake's TCP transport caps any protocol below gloo here "
            f"(cap {statistics.median(caps):.2f}x, its interval {low:.2f}-{high:.2f} below 1.0)"
        )
    else:
        why = (
            f"NOT met, and no cap shown: the cap's interval {low:.2f}-{high:.2f} reaches 1.0 "
            "(more --runs narrow it where the cap is below 1.0)"
        )
    return loadguard.verdict(False, args, why)


def _unmet(cap: float, reached: str) -> str:
    """One run's unmet text for a ping-pong whose cap (vs gloo) in this run is ``cap``
    (``reached``: how near pp_rdma came). One run's cap is a point among widely spread ones
    (0.60-1.33 at 16 MiB over 31 runs): only the pooled verdict (``--runs``) may call it a cap."""
    return f"NOT met (this run's cap {cap:.2f}x{reached}; --runs 5 or more judge the cap)"


def _print_run(
    med: dict, sizes: list[int], reps: int, window: int, args: argparse.Namespace
) -> dict[int, tuple[float, float]]:
    """Sections 1-2 of one run; returns each size's ping-pong ratio and cap (vs gloo)."""
    pingpong: dict[int, tuple[float, float]] = {}
    print(f"\n1. one way, posted -> landed (loopback, median of {reps}), GB/s and vs gloo:")
    for nbytes in sizes:
        g = med[("gloo", nbytes, 0)]
        cells = [
            f"{n} {nbytes / med[(n, nbytes, 0)] / 1e9:5.2f} ({g / med[(n, nbytes, 0)]:4.2f}x)"
            for n in ONE_WAY
        ]
        print(f"  {nbytes >> 10:6d} KiB  " + "  ".join(cells))
    for title, w in (
        ("2. ping-pong, 1 message + reply", 1),
        (f"   streaming, {window} in flight", window),
    ):
        print(f"\n{title} (loopback, median of {reps}):")
        for nbytes in sizes:
            g, m = med[("gloo", nbytes, w)], med[("pp_rdma", nbytes, w)]
            gbs = [nbytes * w / t / 1e9 for t in (g, m)]
            verdict = bound = ""
            if w == 1:  # no protocol over Mooncake can do better than its two bare reads
                floor = med[("raw read", nbytes, 1)] + med[("raw tiny", nbytes, 1)]
                # a read protocol: "the bytes are at addr" -> read -> reply; a write protocol:
                # write into a pre-posted buffer -> "done" -> reply: two signals either way
                moved = min(med[("raw read", nbytes, 1)], med[("raw write", nbytes, 1)])
                signalled = moved + med[("gloo signal", nbytes, 1)]
                bound = (
                    f"  (raw Mooncake reads alone: {g / floor:4.2f}x; raw read or write + "
                    f"gloo-speed signals: {g / signalled:4.2f}x)"
                )
                unmet = _unmet(g / signalled, f"; pp_rdma reaches {signalled / m:.0%} of it")
                verdict = loadguard.verdict(g / m >= 1.0, args, unmet)
                pingpong[nbytes] = (g / m, g / signalled)
            cpu = [med[(n + " cpu", nbytes, w)] * 1e6 for n in ("gloo", "pp_rdma")]
            print(
                f"  {nbytes >> 10:6d} KiB  gloo {gbs[0]:5.2f} GB/s  pp_rdma {gbs[1]:5.2f} GB/s"
                f"  ratio {g / m:5.2f}x{bound}  {verdict}\n"
                f"            CPU per round, both processes: gloo {cpu[0]:6.0f} us  "
                f"pp_rdma {cpu[1]:6.0f} us"
            )
    return pingpong


THREAD_ROLES = ("training thread", "pp_rdma helper", "gloo's threads", "Mooncake, other")


def _thread_times() -> dict[str, tuple[int, int]]:
    """CPU ns and wake-ups so far of this process's threads, summed by role (Linux schedstat:
    run time and times scheduled onto a core, which for a thread that sleeps between events is
    its wake-ups; empty without /proc). Mooncake's engine threads carry no name of their own."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, tuple[int, int]] = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            ns, _, wakeups = task.joinpath("schedstat").read_text().split()[:3]
            comm = task.joinpath("comm").read_text().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        tid = int(task.name)
        if tid == main:
            role = THREAD_ROLES[0]
        elif names.get(tid, "").startswith("pp_rdma-progress"):
            role = THREAD_ROLES[1]
        elif comm.startswith("gloo"):
            role = THREAD_ROLES[2]
        else:
            role = THREAD_ROLES[3]
        cpu, woken = out.get(role, (0, 0))
        out[role] = (cpu + int(ns), woken + int(wakeups))
    return out


def _cpu_by_thread(rounds: int, one_round: Any, *args: Any) -> dict[str, tuple[float, float]]:
    """Microseconds of CPU and wake-ups per round of ``one_round(*args)``, by thread role."""
    dist.barrier()
    before = _thread_times()
    for _ in range(rounds):
        one_round(*args)
    after = _thread_times()
    return {
        role: (
            (ns - before.get(role, (0, 0))[0]) / rounds / 1e3,
            (woken - before.get(role, (0, 0))[1]) / rounds,
        )
        for role, (ns, woken) in after.items()
    }


def _print_threads(threads: dict, sizes: list[int]) -> None:
    """Section 3b: where the CPU of a ping-pong round goes, by thread, both processes."""
    if not threads:
        return
    print(
        "\n3b. CPU per ping-pong round by thread, both processes summed, us (wake-ups), the last "
        "run's\n    (on 2 shared cores the wall time follows the CPU; each wake-up of a thread "
        "whose core slept costs tens of us):"
    )
    print(f"  {'':17s}" + "".join(f"{role:>20s}" for role in (*THREAD_ROLES, "total")))
    for nbytes in sizes:
        for name in ("gloo", "pp_rdma"):
            cells, total = [], 0.0
            for role in THREAD_ROLES:
                got = [rank[name].get(role) for rank in threads[nbytes]]
                cpu = sum(g[0] for g in got if g)
                woken = sum(g[1] for g in got if g)
                total += cpu
                cells.append(f"{cpu:9.0f} ({woken:4.1f})" if cpu >= 1 else "-")
            label = f"{nbytes >> 10} KiB {name}"
            print(f"  {label:17s}" + "".join(f"{c:>20s}" for c in cells) + f"{total:20.0f}")


def _print_phases(phases: dict, sizes: list[int]) -> None:
    """Section 3: the per-phase timers."""
    if not phases:
        return
    from titan_pp_rdma.stats import PHASES

    print("\n3. pp_rdma ping-pong per phase, median us (count) [rank 0 sends, rank 1 reads]:")
    for name, what in PHASES.items():
        print(f"  {name:13s} {what}")
    names = list(PHASES)
    print("  " + " " * 13 + "".join(f"{n:>14s}" for n in names))
    for nbytes in sizes:
        for rank, summary in enumerate(phases[nbytes]):
            cells = "".join(
                f"{summary[n][1] * 1e6:9.0f} ({summary[n][0]:2d})" if n in summary else " " * 14
                for n in names
            )
            print(f"  {nbytes >> 10:6d} KiB r{rank}{cells}")


def step_task(env: dict | None, steps: int, hidden: int) -> dict:
    """One rank of the PP=2 x VPP=2 run: seconds per step and the losses."""
    import contextlib

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

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
        rounds, cpu = _helper_rounds(), _helper_cpu()
        process_cpu, start = _cpu(), time.perf_counter()
        losses, _ = tiny_gpt.train(chunks, cfg, steps=steps, num_microbatches=8)
        elapsed, process_cpu = time.perf_counter() - start, _cpu() - process_cpu
        after, cpu_after = _helper_rounds(), _helper_cpu()
    if env is not None:  # the pool's next run starts without this one's session and helper
        from titan_pp_rdma import session

        session.reset()
    per_step = None if rounds is None or after is None else (after - rounds) / steps
    cpu_per_step = None if cpu is None or cpu_after is None else (cpu_after - cpu) / steps
    return {
        "s_per_step": elapsed / steps,
        "cpu_per_step": process_cpu / steps,
        "losses": losses,
        "helper_rounds": per_step,
        "helper_cpu": cpu_per_step,
    }


def _helper_rounds() -> int | None:
    """Progress rounds the pp_rdma helper threads of this process ran so far (None: no
    Mooncake session, or a pp_rdma without the counter)."""
    from titan_pp_rdma.session import STATE

    counts = [getattr(s.transport, "helper_rounds", None) for s in STATE.sessions.values()]
    counts = [c for c in counts if c is not None]
    return sum(counts) if counts else None


def _helper_cpu() -> float | None:
    """CPU seconds the pp_rdma helper threads of this process used so far (``_thread_times``;
    None without a helper or without /proc). On 2 shared cores it is taken from the training
    threads: each wake-up costs far more there than the few lines it runs."""
    helper = _thread_times().get(THREAD_ROLES[1])
    return None if helper is None else helper[0] / 1e9


def pp2_step_time(reps: int, hidden: int, args: argparse.Namespace) -> None:
    """Section 4: tiny GPT PP=2 x VPP=2 step time, plugin (Mooncake) vs off (gloo).

    Each rep runs every variant once, in an order reversed every other rep (a drift of the
    machine's speed across a rep then biases no variant); a variant's ratio is the median of
    its per-rep ratios to the gloo run of the same rep (paired: this machine's speed drifts
    by 2x within minutes, far more than the difference measured), with their quartiles.
    """
    from titan_plugins.testing.workers import GlooWorkerPool

    runs = {
        "gloo (plugin off)": None,
        "mooncake": {"TITAN_PP_RDMA_BACKEND": "mooncake"},
        "mooncake, no spin": {
            "TITAN_PP_RDMA_BACKEND": "mooncake",
            "TITAN_PP_RDMA_SPIN_US": "0",  # every wait for a record sleeps at once
        },
        "mooncake, reads only": {
            "TITAN_PP_RDMA_BACKEND": "mooncake",
            "TITAN_PP_RDMA_INLINE_BYTES": "0",  # every tensor through a Mooncake read
        },
        "torch fallback (plugin on)": {"TITAN_PP_RDMA_BACKEND": "torch"},
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}  # both ranks' per rep
    rounds: dict[str, list[float]] = {name: [] for name in runs}
    helper_cpu: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list] = {}
    with GlooWorkerPool(2) as pool:
        for rep in range(reps):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for name in order:
                out = pool.run(step_task, runs[name], STEPS, hidden, timeout=600)
                times[name].append(max(r["s_per_step"] for r in out))
                cpus[name].append(sum(r["cpu_per_step"] for r in out))
                rounds[name] += [r["helper_rounds"] for r in out if r["helper_rounds"] is not None]
                helper_cpu[name] += [r["helper_cpu"] for r in out if r["helper_cpu"] is not None]
                losses[name] = out[1]["losses"]
    base = times["gloo (plugin off)"]
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    kib = tiny_gpt.SEQ * tiny_gpt.MBS * hidden * 4 >> 10
    print(
        f"\n4. PP=2 x VPP=2 tiny GPT (hidden {hidden}, {kib} KiB per pipeline message, "
        f"8 microbatches, {STEPS} steps per run), {reps} reps, ratio = median over reps of "
        "gloo's time / the variant's in the same rep [quartiles]; CPU: every thread of both "
        "processes (on 2 shared cores the wall time follows it):"
    )
    for name in runs:
        paired = [g / t for g, t in zip(base, times[name], strict=True)]
        q1, ratio, q3 = _quartiles(paired)
        same = "same losses" if losses[name] == losses["gloo (plugin off)"] else "LOSSES DIFFER"
        verdict = loadguard.verdict(ratio >= 1.0, args) if name == "mooncake" else ""
        cpu_ratio = statistics.median(
            g / c for g, c in zip(cpus["gloo (plugin off)"], cpus[name], strict=True)
        )
        helper = (
            f"; helper rounds per step and rank {statistics.median(rounds[name]):.0f}"
            if rounds[name]
            else ""
        )
        if helper_cpu[name]:
            helper += f", their CPU {statistics.median(helper_cpu[name]) * 1e3:.1f} ms"
        print(
            f"  {name:28s} {statistics.median(times[name]) * 1e3:7.1f} ms/step  "
            f"ratio {ratio:5.2f}x [{q1:4.2f}-{q3:4.2f}]  ({same})  {verdict}\n"
            f"  {'':28s} CPU per step, both processes {statistics.median(cpus[name]) * 1e3:.0f} ms"
            f" (gloo's / this {cpu_ratio:4.2f}x){helper}"
        )


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """First quartile, median, third quartile (the value itself when there is one)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, statistics.median(values), q3


def _gpu_worker(rank: int, port: int, sizes: list[int], reps: int, device: str, q: Any) -> None:
    """One rank of the GPU section: bf16 ``device`` tensors, ping-pong over the baseline group
    and over pp_rdma's Mooncake transport (ring buffers), payload checked after every round.

    Baseline: NCCL when each rank has its own GPU; with one GPU for both ranks (NCCL refuses two
    ranks on one device) the tensors go device -> host -> gloo -> device, what such a user gets;
    on CPU (``--gpu-smoke``) gloo itself.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device == "cuda"
    own_gpu = cuda and torch.cuda.device_count() >= 2
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if own_gpu else "gloo", rank=rank, world_size=2)
    baseline = "nccl" if own_gpu else ("gloo via host" if cuda else "gloo")
    from titan_pp_rdma.session import open_session
    from titan_pp_rdma.settings import PPRdmaSettings

    settings = PPRdmaSettings(backend="mooncake", buffers="ring", timeout_s=60)
    tr = open_session(dist.group.WORLD, settings).transport

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def via_host(x: torch.Tensor, y: torch.Tensor, ack: torch.Tensor) -> None:
        hx, hy, hack = x.cpu(), torch.empty_like(y, device="cpu"), ack.cpu()
        _gloo_round(hx, hy, hack, rank, 1)
        y.copy_(hy)
        ack.copy_(hack)

    out: dict[str, Any] = {"baseline": baseline}
    ok = True
    for nbytes in sizes:
        x = torch.full((1, nbytes // 2), 1.0 + rank, dtype=torch.bfloat16, device=device)
        y, ack = torch.empty_like(x), torch.zeros(1, device=device)
        for name in ("baseline", "mooncake"):
            ts = []
            for _ in range(reps + 1):
                y.zero_()
                dist.barrier()
                sync()
                start = time.perf_counter()
                if name == "mooncake":
                    _mooncake_round(tr, x, y, ack, rank, 1)
                elif baseline == "gloo via host":
                    via_host(x, y, ack)
                else:
                    _gloo_round(x, y, ack, rank, 1)  # the same calls on an NCCL group
                sync()
                ts.append(time.perf_counter() - start)
                if rank == 1:  # rank 0's ones landed, bit for bit
                    ok = ok and bool(y.eq(1.0).all())
            out[f"{name} {nbytes}"] = statistics.median(ts[1:])
    out["payload_ok"] = ok
    if rank == 1:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def gpu_section(sizes: list[int], reps: int, smoke: bool) -> None:
    """The GPU section (``--section gpu``; ``scripts/gpu_check.sh``): device-tensor ping-pong,
    Mooncake (RDMA when a NIC is visible, else TCP; ring buffers) vs the baseline group."""
    if not smoke and not torch.cuda.is_available():
        print("\nGPU section: skipped (no CUDA device; --gpu-smoke runs it tiny on CPU)")
        return
    device = "cpu" if smoke else "cuda"
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _gpu_worker,
        args=(free_port(), sizes, reps, device, q),
        nprocs=2,
        start_method="spawn",
    )
    med = q.get()
    print(f"\nGPU section ({device}, bf16 ping-pong vs {med['baseline']}), median of {reps}:")
    ratios = {}
    for nbytes in sizes:
        n, m = med[f"baseline {nbytes}"], med[f"mooncake {nbytes}"]
        ratios[f"ratio_{nbytes >> 10}KiB"] = n / m
        print(
            f"  {nbytes >> 10:6d} KiB  {med['baseline']} {nbytes / n / 1e9:6.2f} GB/s  "
            f"mooncake {nbytes / m / 1e9:6.2f} GB/s  ratio {n / m:5.2f}x"
        )
    print(f"  payload checked after every round: {'ok' if med['payload_ok'] else 'CORRUPTED'}")
    import gpu_check

    gpu_check.emit(
        {"device": device, "baseline": med["baseline"], "payload_ok": med["payload_ok"], **ratios}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1,
                        help="sections 1-3 in this many fresh process pairs, ping-pong pooled")  # fmt: skip
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=list(SIZES_KIB))
    parser.add_argument("--hidden", type=int, default=256, help="tiny GPT hidden size (PP=2 run)")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--skip-loopback", action="store_true")
    parser.add_argument("--section", choices=("all", "gpu"), default="all",
                        help="gpu: only the GPU section (scripts/gpu_check.sh)")  # fmt: skip
    parser.add_argument("--gpu-smoke", action="store_true", help="run the GPU section tiny on CPU")
    args = begin(parser)
    if args.runs < 1:
        raise SystemExit(f"--runs {args.runs}: at least one run is needed")
    sizes = [k << 10 for k in args.sizes_kib]
    if args.section == "gpu":
        small = [k << 10 for k in (64, 1024)] if args.gpu_smoke else sizes
        gpu_section(small, 3 if args.gpu_smoke else args.reps, args.gpu_smoke)
        return
    if not args.skip_loopback:
        loopback(sizes, args.reps, args.window, args)
    if not args.skip_megatron:
        pp2_step_time(args.reps, args.hidden, args)
    gpu_section(sizes, args.reps, smoke=False)
    print("\n" + loadguard.describe(args) + "  (at the end)")


if __name__ == "__main__":
    main()
