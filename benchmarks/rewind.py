"""Rewind (plugin ``rewind``): step-time overhead of host snapshots, host bytes per snapshot, and
time to rewind, against the plugin off in the same run.

1. ``cpu``: the tiny MoE GPT (hidden 256, 4 experts, seq 64, 4 microbatches, fp32, Adam) through
   megatron-core's schedules in one gloo worker. Modes: plugin off, detection only (no snapshot:
   budget 1 byte), and snapshots every N = 100, 10, 1 steps (``STABLE_AFTER=1``, so the interval
   is exactly N), each on its own model replica and state machine, interleaved step by step (a
   shared machine's load drifts hit every mode alike). Overhead at N = detection (median of the
   paired detect - off step times) + one snapshot (median capture time, from N = 1) / N, over
   the median step time off; the direct ratio of mean step times is printed beside it.
   Goal: <= 1.02x at N = 10. Then host bytes per snapshot against the parameter + optimizer
   bytes counted independently, and the time of a restore (median of 5).
2. ``gpu``: a bf16 MLP stack with fp32 masters and torch Adam on CUDA, snapshotted through the
   same Snapshotter (pinned host buffers, side stream, fenced before the update): step time at
   N = 10 and 1 vs off, bytes, restore time. Needs CUDA; ``--gpu-smoke`` runs it tiny on CPU.

Usage: python benchmarks/rewind.py [--section cpu|gpu|all] [--steps 200] [--rounds 3] [--force]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import Any

import loadguard

MODES = ("off", "detect", "N=100", "N=10", "N=1")
SIZE = dict(hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_layers=2)
NMB = 4


# ----- 1. CPU (one gloo worker) ----------------------------------------------------------------
def _config(mode: str) -> Any:
    from titan_rewind.config import RewindConfig

    if mode == "detect":  # a 1-byte budget: checks run, no snapshot is ever taken
        return RewindConfig(stable_after=1, max_host_bytes=1)
    return RewindConfig(interval=int(mode[2:]), stable_after=1)


def cpu_task(steps: int) -> dict[str, Any]:
    """Per-step times of every mode, interleaved step by step, plus bytes and restore times.

    One activation holds the plugin; each mode trains its own replica of the model (same
    initial weights) under its own persistent state machine, so each keeps its snapshot
    schedule while the modes alternate every step. "off" unregisters the plugin for its step:
    the core then calls megatron directly, as when the plugin is not installed.
    """
    from titan_rewind import runtime
    from titan_rewind.runtime import Rewinder

    from titan_plugins import active_manager
    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    logging.getLogger("titan_plugins").setLevel(logging.ERROR)  # detect mode warns on budget
    tiny_gpt.SEQ = 64
    replicas = {}
    for mode in MODES:
        tiny_gpt.init_parallel()
        cfg = tiny_gpt.make_config(**SIZE)
        chunks = tiny_gpt.build_model(cfg)
        replicas[mode] = (chunks, cfg, tiny_gpt.make_optimizer(chunks, cfg))
    rewinders = {mode: Rewinder(_config(mode)) for mode in MODES if mode != "off"}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with plugin_active("rewind"):
        pm = active_manager()
        plugin = pm.get_plugin("rewind")
        for index in range(steps + 3):
            shift = index % len(MODES)  # rotate the order: no mode always runs first
            for mode in MODES[shift:] + MODES[:shift]:
                registered = pm.get_plugin("rewind") is not None
                if mode == "off" and registered:
                    pm.unregister(name="rewind")
                elif mode != "off":
                    if not registered:
                        pm.register(plugin, name="rewind")
                    runtime._CURRENT[:] = [rewinders[mode]]
                chunks, cfg, optimizer = replicas[mode]
                start = time.perf_counter()
                tiny_gpt.train(chunks, cfg, 1, NMB, optimizer=optimizer)
                if index >= 3:  # the first rounds warm up (Adam state, host buffers)
                    times[mode].append(time.perf_counter() - start)
        if pm.get_plugin("rewind") is None:
            pm.register(plugin, name="rewind")
        chunks, cfg, optimizer = replicas["N=10"]
        store = rewinders["N=10"].store
        restores = []
        for _ in range(5):
            start = time.perf_counter()
            store.restore(chunks, optimizer)
            restores.append(time.perf_counter() - start)
    captures = list(rewinders["N=1"].store.recent_captures)
    # Independent count: every parameter, and every tensor of the torch optimizers' state.
    param_bytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    state_bytes = 0
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        for values in leaf.optimizer.state.values():
            state_bytes += sum(
                v.numel() * v.element_size() for v in values.values() if hasattr(v, "numel")
            )
    return {
        "times": times,
        "taken": {mode: r.store.taken for mode, r in rewinders.items()},
        "capture_s": statistics.median(captures),
        "planned": store.planned,
        "param_bytes": param_bytes,
        "state_bytes": state_bytes,
        "params": sum(p.numel() for c in chunks for p in c.parameters()),
        "restore_s": statistics.median(restores),
    }


def cpu_section(args: argparse.Namespace) -> None:
    from titan_plugins.testing.workers import GlooWorkerPool

    with GlooWorkerPool(1) as pool:
        (out,) = pool.run(cpu_task, args.steps, timeout=3600)
    times = out["times"]
    off = statistics.median(times["off"])
    paired = [d - o for d, o in zip(times["detect"], times["off"])]
    detect = statistics.median(paired)
    capture = out["capture_s"]
    print(
        f"\n[cpu] tiny MoE GPT {out['params'] / 1e6:.2f} M params (hidden 256, seq 64, "
        f"{NMB} microbatches, fp32 + Adam), world size 1; {args.steps} steps per mode, "
        "modes interleaved step by step"
    )
    print(f"  {'mode':7} {'median':>9} {'mean':>9} {'snapshots':>9}")
    for mode in MODES:
        taken = out["taken"].get(mode, 0)
        med, mean = statistics.median(times[mode]), statistics.mean(times[mode])
        print(f"  {mode:7} {med * 1e3:7.2f}ms {mean * 1e3:7.2f}ms {taken:>9}")
    print(
        f"  detection (median of paired detect - off): {detect * 1e3:+.3f} ms/step "
        f"= {detect / off:+.2%}; one snapshot (median of {min(len(times['N=1']), 100)}): "
        f"{capture * 1e3:.2f} ms = {capture / off:.2%} of a step"
    )
    ratios = {}
    for n in (100, 10, 1):
        ratios[n] = 1 + (detect + capture / n) / off
        mean_ratio = statistics.mean(times[f"N={n}"]) / statistics.mean(times["off"])
        print(
            f"  N={n:<3} overhead = detection + snapshot/N: {ratios[n]:.4f}x   "
            f"(direct ratio of means {mean_ratio:.3f}x)"
        )
    planned, counted = out["planned"], out["param_bytes"] + out["state_bytes"]
    print(
        f"  host bytes per snapshot: {planned / 2**20:.2f} MiB = {planned / counted:.3f}x the "
        f"parameter + optimizer bytes ({out['param_bytes'] / 2**20:.2f} + "
        f"{out['state_bytes'] / 2**20:.2f} MiB); two snapshots held: {2 * planned / 2**20:.2f} MiB"
    )
    restore = out["restore_s"]
    print(
        f"  rewind (restore of the stable snapshot, median of 5): {restore * 1e3:.2f} ms "
        f"= {restore / off:.2f} steps"
    )
    print(
        f"  goal: N=10 <= 1.02x: {ratios[10]:.4f}x -> {loadguard.verdict(ratios[10] <= 1.02, args)}"
    )


# ----- 2. GPU: pinned host copies on a side stream ---------------------------------------------
class MixedPrecisionAdam:
    """bf16 model params, fp32 masters stepped by torch Adam (megatron's Float16 layout)."""

    def __init__(self, params: list[Any]) -> None:
        import torch

        self.model_params = params
        self.masters = [p.detach().float().clone().requires_grad_() for p in params]
        self.optimizer = torch.optim.Adam(self.masters, lr=1e-4)

    def step(self) -> None:
        import torch

        for model, master in zip(self.model_params, self.masters):
            master.grad = model.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for model, master in zip(self.model_params, self.masters):
                model.copy_(master)


def gpu_run(
    device: str, hidden: int, layers: int, tokens: int, steps: int, interval: int | None
) -> tuple[float, int, float]:
    """Mean step time (s), bytes per snapshot, restore time (s) for one mode."""
    import torch
    from titan_rewind.store import SnapshotStore

    from titan_plugins import platform

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]
    ).to(device=device, dtype=dtype)
    optimizer = MixedPrecisionAdam(list(model.parameters()))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    store = SnapshotStore(interval or 1, 1, 1 << 40) if interval else None

    def step(index: int) -> None:
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        if store is not None:
            store.fence()  # as the plugin does before the update
        optimizer.step()
        if store is not None:
            store.on_healthy_step(index, [model], optimizer)

    for index in range(3):
        step(index)
    sync = platform.current_stream().synchronize
    sync()
    start = time.perf_counter()
    for index in range(3, 3 + steps):
        step(index)
    sync()
    mean = (time.perf_counter() - start) / steps
    restore = 0.0
    if store is not None:
        started = time.perf_counter()
        store.restore([model], optimizer)
        restore = time.perf_counter() - started
    return mean, (store.planned if store else 0), restore


def gpu_section(args: argparse.Namespace) -> None:
    import torch

    smoke = args.gpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("\n[gpu] skipped: CUDA not available (run on the device machine, or --gpu-smoke)")
        return
    device = "cpu" if smoke else "cuda"
    hidden, layers, tokens, steps = (64, 2, 32, 20) if smoke else (4096, 16, 8192, 50)
    rows = {}
    for _ in range(args.rounds):
        for mode, interval in (("off", None), ("N=10", 10), ("N=1", 1)):
            rows.setdefault(mode, []).append(
                gpu_run(device, hidden, layers, tokens, steps, interval)
            )
    base = statistics.median(r[0] for r in rows["off"])
    print(
        f"\n[gpu] {device}: {layers} x Linear({hidden}) bf16 + fp32 masters + Adam, {tokens} "
        f"tokens/step, {steps} steps x {args.rounds} rounds"
    )
    for mode, results in rows.items():
        med = statistics.median(r[0] for r in results)
        planned = results[0][1]
        restore = statistics.median(r[2] for r in results)
        extra = (
            f"  {planned / 2**20:.1f} MiB/snapshot, restore {restore * 1e3:.1f} ms"
            if planned
            else ""
        )
        print(f"  {mode:5} {med * 1e3:8.2f} ms/step  {med / base:6.3f}x{extra}")
    ratio = statistics.median(r[0] for r in rows["N=10"]) / base
    if not smoke:
        print(
            f"  goal: N=10 <= 1.02x of off: {ratio:.3f}x -> {loadguard.verdict(ratio <= 1.02, args)}"
        )
    import gpu_check

    gpu_check.emit(
        {
            "step_ms_off": base * 1e3,
            "ratio_n10": ratio,
            "ratio_n1": statistics.median(r[0] for r in rows["N=1"]) / base,
            "snapshot_mib": rows["N=10"][0][1] / 2**20,
            "restore_ms": statistics.median(r[2] for r in rows["N=1"]) * 1e3,
        }
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--section", choices=("cpu", "gpu", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per mode [cpu]")
    parser.add_argument("--gpu-smoke", action="store_true", help="run [gpu] tiny on CPU")
    loadguard.add_arguments(parser)
    args = parser.parse_args(argv)
    print(f"benchmarks/rewind.py {' '.join(argv or sys.argv[1:])}")
    print(loadguard.describe(args))
    if args.section in ("cpu", "all"):
        cpu_section(args)
    if args.section in ("gpu", "all"):
        gpu_section(args)
    print(loadguard.describe(args))


if __name__ == "__main__":
    sys.exit(main())
