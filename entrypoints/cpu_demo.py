"""CPU demo: a tiny MoE GPT trained for a few dozen steps through megatron-core's own schedules,
with every installed Titan plugin active through the real automatic channel.

Run under torchrun (``scripts/demo.sh`` does)::

    torchrun --nproc-per-node 4 entrypoints/cpu_demo.py --pp 2 --ep 2 --steps 30

Each worker installs the CPU test harness (CPU only; never part of a GPU job), then imports
megatron.core: the torch.backends entry point has armed the registry, so the installed plugins
load and patch Megatron as it is imported, exactly as in a user's ``pretrain_gpt.py`` run. The
model configuration asks for what the enabled plugins provide (blockwise FP8, the flex
dispatcher). Rank 0 prints the plugin report, the loss of every step, then what every plugin
measurably did on every rank (gathered from each rank's ``titan_effects``), and the trace
analyzer's summary of the steps it captured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

DEFAULT_OUT = "demo_out"


def _feature_overrides(enabled: set[str]) -> dict:
    """Megatron config that exercises the enabled plugins (none of these flags is Titan's own)."""
    overrides: dict = {}
    if "fp8_blockwise" in enabled:
        overrides.update(fp8="e4m3", fp8_recipe="blockwise")
    if "moe_ep_overlap" in enabled:
        overrides.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    return overrides


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--hidden", type=int, default=128, help="hidden size (FP8 tiles are 128 wide)"
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for traces and the report")
    parser.add_argument(
        "--trace-steps",
        default="2-3",
        help="training steps the trace_analysis plugin captures (TITAN_TRACE_STEPS), "
        "'none' to capture nothing",
    )
    parser.add_argument(
        "--report", default=None, metavar="PATH", help="write every rank's effects as JSON"
    )
    parser.add_argument(
        "--inject-fault",
        type=int,
        default=None,
        metavar="STEP",
        help="make step STEP's loss NaN on every rank (test-only knob of the rewind plugin), "
        "to watch rewind roll back and go on",
    )
    return parser.parse_args()


def _demo_environment(args: argparse.Namespace) -> None:
    """Plugin knobs the demo chooses, set before megatron is imported (activation reads them).
    A value the user exported wins."""
    if args.trace_steps != "none":
        os.environ.setdefault("TITAN_TRACE_STEPS", args.trace_steps)
        os.environ.setdefault("TITAN_TRACE_DIR", os.path.join(args.out, "traces"))
    if args.inject_fault is not None:
        os.environ["TITAN_REWIND_INJECT_NAN_STEP"] = str(args.inject_fault)


def main() -> None:
    args = _parse_args()
    _demo_environment(args)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    import torch

    torch.set_num_threads(1)
    from titan_plugins.testing import cpu_harness

    cpu_harness.install()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    import megatron.core  # noqa: F401  # the registry activates here (torch.backends channel)

    from titan_plugins import report
    from titan_plugins.testing import tiny_gpt

    data = report.collect()
    enabled = {p["name"] for p in data["plugins"] if p["state"] == "enabled"}
    tiny_gpt.init_parallel(pp=args.pp, ep=args.ep, vpp=args.vpp)
    cfg = tiny_gpt.make_config(
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        **_feature_overrides(enabled),
    )
    chunks = tiny_gpt.build_model(cfg, vpp=args.vpp)
    if rank == 0:
        _print_report(report.collect())
    started = time.perf_counter()
    losses, grad_norms = tiny_gpt.train(
        chunks, cfg, steps=args.steps, num_microbatches=args.microbatches
    )
    elapsed = time.perf_counter() - started
    if losses:  # last pipeline stage, first data-parallel rank prints
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0:
            for step, (loss, norm) in enumerate(zip(losses, grad_norms)):
                print(f"step {step:3d}  loss {loss:.4f}  grad-norm {norm:.4f}", flush=True)
            print(
                f"trained {args.steps} steps in {elapsed:.1f}s; "
                f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
                flush=True,
            )
    effects: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(effects, report.effects())
    if rank == 0:
        print(effects_table(effects), flush=True)
        if args.report:
            _write_report(args.report, effects, report.collect())
    dist.barrier()  # every rank has written its trace before rank 0 reads them
    if rank == 0 and args.trace_steps != "none" and "trace_analysis" in enabled:
        print(_trace_summary(os.environ["TITAN_TRACE_DIR"]), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def effects_table(per_rank: list[dict[str, dict[str, Any]]]) -> str:
    """One row per plugin and measure, one column per rank: what each plugin did, counted."""
    rows: list[tuple[str, str]] = []
    for effects in per_rank:
        for plugin, measures in (effects or {}).items():
            for key in measures:
                if (plugin, key) not in rows:
                    rows.append((plugin, key))
    ranks = [f"rank {r}" for r in range(len(per_rank))]
    cells = [
        [_cell((per_rank[r] or {}).get(plugin, {}).get(key)) for r in range(len(per_rank))]
        for plugin, key in rows
    ]
    width = max([len(c) for row in cells for c in row] + [len(r) for r in ranks] + [6])
    name_w = max([len(p) for p, _ in rows] + [6])
    key_w = max([len(k) for _, k in rows] + [7])
    lines = ["", "what each plugin did (measured on every rank after training):"]
    lines.append(f"  {'plugin':<{name_w}}  {'measure':<{key_w}}  " + "  ".join(
        f"{r:>{width}}" for r in ranks
    ))  # fmt: skip
    for (plugin, key), row in zip(rows, cells):
        lines.append(f"  {plugin:<{name_w}}  {key:<{key_w}}  " + "  ".join(
            f"{c:>{width}}" for c in row
        ))  # fmt: skip
    if not rows:
        lines.append("  (no plugin reported an effect)")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _write_report(path: str, effects: list[Any], data: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as out:
        json.dump({"effects_per_rank": effects, "report": data}, out, indent=2, default=str)
    print(f"report written to {path}", flush=True)


def _trace_summary(trace_dir: str) -> str:
    """The analyzer's summary of the captured steps, through the plugin's public command (the
    core never imports a plugin); never raises: the run is done."""
    import shutil
    import subprocess
    import sys

    command = shutil.which("titan-trace") or os.path.join(
        os.path.dirname(sys.executable), "titan-trace"
    )
    out_dir = os.path.join(os.path.dirname(os.path.abspath(trace_dir)), "trace_report")
    try:
        done = subprocess.run(
            [command, "analyze", trace_dir, "--out", out_dir],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"trace analysis unavailable ({type(err).__name__}: {err})"
    text = (done.stdout + done.stderr).rstrip()
    html = os.path.join(out_dir, "report.html")
    if os.path.exists(html):
        text += f"\nHTML report: {html}"
    return "\ntrace analysis of the captured steps (titan-trace analyze):\n" + text


def _print_report(data: dict) -> None:
    print(f"titan-plugins {data['core_version']}: active via {data['channel']}", flush=True)
    megatron = data.get("megatron") or {}
    if megatron:
        print(f"  megatron: {megatron.get('summary')}", flush=True)
    for plugin in data["plugins"]:
        applied = sum(p["status"] == "applied" for p in plugin["patches"])
        why = f" ({plugin['reason']})" if plugin["reason"] else ""
        print(
            f"  {plugin['name']:<16} {plugin['version']:<8} {plugin['state']}{why}; "
            f"{applied}/{len(plugin['patches'])} patches applied",
            flush=True,
        )


if __name__ == "__main__":
    main()
