"""Rewind (plugin ``rewind``): step-time overhead of host snapshots, host bytes per snapshot, and
time to rewind, against the plugin off in the same run.

1. ``cpu``: the tiny MoE GPT (hidden 256, 4 experts, seq 64, 4 microbatches, fp32, Adam) through
   megatron-core's schedules in one gloo worker. Modes, each a block of ``--block`` steps under
   its own activation (so a block of 100 holds 100/N snapshots, the steady-state rate): plugin
   off, detection only (no snapshot: budget 1 byte), and snapshots every N = 100, 10, 1 steps
   (``STABLE_AFTER=1``, so the interval is exactly N). Rounds alternate the modes; the median
   over rounds of each block's mean step time is compared with the plugin off.
   Goal: <= 1.02x at N = 10. Then host bytes per snapshot against the parameter + optimizer
   bytes counted independently, and the time of a rewind (NaNs injected, median).
2. ``gpu``: a bf16 MLP stack with fp32 masters and torch Adam on CUDA, snapshotted through the
   same Snapshotter (pinned host buffers, side stream, fenced before the update): step time at
   N = 10 and 1 vs off, bytes, restore time. Needs CUDA; ``--gpu-smoke`` runs it tiny on CPU.

Usage: python benchmarks/rewind.py [--section cpu|gpu|all] [--rounds 3] [--block 100] [--force]
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


def _env(mode: str) -> dict[str, str] | None:
    if mode == "off":
        return None
    env = {"TITAN_REWIND_STABLE_AFTER": "1"}
    if mode == "detect":
        env["TITAN_REWIND_MAX_HOST_BYTES"] = "1"
    else:
        env["TITAN_REWIND_INTERVAL"] = mode[2:]
    return env


# ----- 1. CPU (one gloo worker) ----------------------------------------------------------------
def cpu_task(rounds: int, block: int) -> dict[str, Any]:
    """Block means per mode, bytes, and rewind times, on this worker."""
    import contextlib

    import titan_rewind

    from titan_plugins.testing import plugin_active, tiny_gpt

    logging.getLogger("titan_plugins").setLevel(logging.ERROR)  # detect mode warns on budget
    tiny_gpt.SEQ = 64
    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_config(**SIZE)
    chunks = tiny_gpt.build_model(cfg)
    optimizer = tiny_gpt.make_optimizer(chunks, cfg)
    tiny_gpt.train(chunks, cfg, 3, NMB, optimizer=optimizer)  # warm-up (allocates Adam state)
    means: dict[str, list[float]] = {mode: [] for mode in MODES}
    captures: list[float] = []
    for _ in range(rounds):
        for mode in MODES:
            env = _env(mode)
            context = plugin_active("rewind", env) if env else contextlib.nullcontext()
            with context:
                start = time.perf_counter()
                tiny_gpt.train(chunks, cfg, block, NMB, optimizer=optimizer)
                means[mode].append((time.perf_counter() - start) / block)
                if env and mode != "detect":
                    effect = titan_rewind.effect()
                    captures.append(effect["capture_s"] / max(effect["snapshots_taken"], 1))
                    planned = effect["bytes_per_snapshot"]
    # Independent count: every parameter, and every tensor of the torch optimizers' state.
    param_bytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    state_bytes = 0
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        for values in leaf.optimizer.state.values():
            state_bytes += sum(
                v.numel() * v.element_size() for v in values.values() if hasattr(v, "numel")
            )
    env = {"TITAN_REWIND_STABLE_AFTER": "1", "TITAN_REWIND_INTERVAL": "10"}
    env["TITAN_REWIND_INJECT_NAN_STEP"] = "15,35,55"
    env["TITAN_REWIND_ESCALATE_WINDOW"] = "1"
    with plugin_active("rewind", env):
        tiny_gpt.train(chunks, cfg, 60, NMB, optimizer=optimizer)
        events = titan_rewind.effect()["events"]
    params = sum(p.numel() for c in chunks for p in c.parameters())
    return {
        "means": means,
        "capture_s": statistics.median(captures),
        "planned": planned,
        "param_bytes": param_bytes,
        "state_bytes": state_bytes,
        "params": params,
        "rewind_s": [e["seconds"] for e in events],
    }


def cpu_section(args: argparse.Namespace) -> None:
    from titan_plugins.testing.workers import GlooWorkerPool

    with GlooWorkerPool(1) as pool:
        (out,) = pool.run(cpu_task, args.rounds, args.block, timeout=3600)
    means = out["means"]
    base = statistics.median(means["off"])
    print(
        f"\n[cpu] tiny MoE GPT {out['params'] / 1e6:.2f} M params (hidden 256, seq 64, "
        f"{NMB} microbatches, fp32 + Adam), world size 1; {args.rounds} rounds x {args.block} "
        "steps per mode; median over rounds of each block's mean step time"
    )
    ratios = {}
    for mode in MODES:
        med = statistics.median(means[mode])
        ratios[mode] = med / base
        spread = f"{min(means[mode]) * 1e3:.1f}-{max(means[mode]) * 1e3:.1f}"
        print(f"  {mode:7} {med * 1e3:8.2f} ms/step  {ratios[mode]:6.3f}x  (blocks {spread} ms)")
    planned, counted = out["planned"], out["param_bytes"] + out["state_bytes"]
    print(
        f"  capture (median): {out['capture_s'] * 1e3:.2f} ms per snapshot; "
        f"{planned / 2**20:.2f} MiB per snapshot = {planned / counted:.3f}x the parameter + "
        f"optimizer bytes ({out['param_bytes'] / 2**20:.2f} + {out['state_bytes'] / 2**20:.2f} "
        f"MiB); two snapshots held: {2 * planned / 2**20:.2f} MiB"
    )
    rewinds = out["rewind_s"]
    print(
        f"  rewind (restore of the stable snapshot, {len(rewinds)} NaNs): median "
        f"{statistics.median(rewinds) * 1e3:.2f} ms = {statistics.median(rewinds) / base:.2f} steps"
    )
    print(
        f"  goal: N=10 <= 1.02x of off: {ratios['N=10']:.3f}x -> "
        f"{loadguard.verdict(ratios['N=10'] <= 1.02, args)}"
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
    if not smoke:
        ratio = statistics.median(r[0] for r in rows["N=10"]) / base
        print(
            f"  goal: N=10 <= 1.02x of off: {ratio:.3f}x -> {loadguard.verdict(ratio <= 1.02, args)}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--section", choices=("cpu", "gpu", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode")
    parser.add_argument("--block", type=int, default=100, help="steps per mode and round [cpu]")
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
