"""CPU demo: a tiny MoE GPT trained for a few dozen steps through megatron-core's own schedules,
with every installed Titan plugin active through the real automatic channel.

Run under torchrun (``scripts/demo.sh`` does)::

    torchrun --nproc-per-node 4 entrypoints/cpu_demo.py --pp 2 --ep 2 --steps 30

Each worker installs the CPU test harness (CPU only; never part of a GPU job), then imports
megatron.core: the torch.backends entry point has armed the registry, so the installed plugins
load and patch Megatron as it is imported, exactly as in a user's ``pretrain_gpt.py`` run. The
model configuration asks for what the enabled plugins provide (blockwise FP8, the flex
dispatcher); rank 0 prints the plugin report, then the loss of every step.
"""

from __future__ import annotations

import argparse
import os
import time


def _feature_overrides(enabled: set[str]) -> dict:
    """Megatron config that exercises the enabled plugins (none of these flags is Titan's own)."""
    overrides: dict = {}
    if "fp8_blockwise" in enabled:
        overrides.update(fp8="e4m3", fp8_recipe="blockwise")
    if "moe_ep_overlap" in enabled:
        overrides.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    return overrides


def main() -> None:
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
    args = parser.parse_args()

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
    if losses:  # last pipeline stage, first data-parallel rank prints
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0:
            for step, (loss, norm) in enumerate(zip(losses, grad_norms)):
                print(f"step {step:3d}  loss {loss:.4f}  grad-norm {norm:.4f}", flush=True)
            print(
                f"trained {args.steps} steps in {time.perf_counter() - started:.1f}s; "
                f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


def _print_report(data: dict) -> None:
    print(f"titan-plugins {data['core_version']}: active via {data['channel']}", flush=True)
    for plugin in data["plugins"]:
        applied = sum(p["status"] == "applied" for p in plugin["patches"])
        why = f" ({plugin['reason']})" if plugin["reason"] else ""
        print(
            f"  {plugin['name']:<16} {plugin['version']:<8} {plugin['state']}{why}; "
            f"{applied}/{len(plugin['patches'])} patches applied",
            flush=True,
        )
        for key, value in (plugin.get("report") or {}).items():
            print(f"      {key}: {value}", flush=True)


if __name__ == "__main__":
    main()
