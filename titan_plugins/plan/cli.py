"""``titan-plugins plan``: per-rank memory, FLOPs and fit of a Megatron-LM launch.

Usage::

    titan-plugins plan [options] LAUNCH_SCRIPT [-- extra Megatron flags]
    titan-plugins plan [options] --world-size N -- --num-layers 2 --hidden-size 64 ...

Variables of the script default from the environment, as bash would (``PP=8 titan-plugins plan
script.sh``). Sizes are GiB (``80GB`` = ``80GiB`` = 80 * 2**30 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from titan_plugins.plan.flags import PlanError, parse_flags
from titan_plugins.plan.from_flags import build_config
from titan_plugins.plan.report import build_report, render_text
from titan_plugins.plan.script import read_launch_script


def parse_size(text: str) -> float:
    """``80GB`` / ``80G`` / ``80GiB`` / ``141`` (GiB) / ``512MiB`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.I)
    if not m:
        raise PlanError(f"--device-memory: cannot read {text!r} (e.g. 80GB, 141GiB)")
    scale = {"": 2**30, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    return float(m.group(1)) * scale


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titan-plugins plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("script", nargs="?", help="bash launch script running pretrain_gpt.py")
    p.add_argument("--world-size", type=int, help="number of GPUs (default: from torchrun args)")
    p.add_argument("--device-memory", help="memory per GPU, e.g. 80GB: report whether it fits")
    p.add_argument(
        "--reserve",
        type=float,
        default=0.1,
        help="fraction of device memory kept free for workspace, allocator "
        "fragmentation and communication buffers (default 0.1)",
    )
    p.add_argument("--step-time", type=float, help="measured seconds per step: report MFU")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="peak dense TFLOP/s per GPU for MFU (default 989, H100/H800 BF16)",
    )
    p.add_argument(
        "--act-offload-resident",
        type=int,
        default=1,
        help="in-flight units whose activations an offloading plugin keeps on the device "
        "(act_offload holds about one: the block staged in forward, or the block backward "
        "reads and the one prefetched; measured in tests/test_compose_matrix.py)",
    )
    p.add_argument("--entry", default="pretrain_gpt.py", help="script the launcher runs")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``plan`` options before ``--``, Megatron flags after it."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return _parser().parse_args(argv[:cut]), argv[cut + 1 :]


def plan_from_argv(argv: list[str], env: dict[str, str] | None = None) -> dict:
    """Parse ``plan`` arguments and return the report dict (raises PlanError on bad input).

    ``env`` is the environment the launch script's variables default from (``os.environ``).
    """
    args, extra = _split(argv)
    world = args.world_size
    megatron: list[str] = []
    if args.script:
        if not os.path.isfile(args.script):
            raise PlanError(f"launch script {args.script!r} not found")
        with open(args.script) as fh:
            launch = read_launch_script(
                fh.read(), dict(os.environ if env is None else env), args.entry
            )
        megatron = launch.megatron_args
        world = world or launch.world_size
    megatron += extra
    if not megatron:
        raise PlanError("no Megatron flags: give a launch script or flags after '--'")
    if not world:
        raise PlanError("world size unknown: pass --world-size N (number of GPUs)")
    flags = parse_flags(megatron)
    cfg = build_config(flags, world)
    return build_report(
        cfg,
        device_bytes=parse_size(args.device_memory) if args.device_memory else None,
        reserve=args.reserve,
        step_time=args.step_time,
        peak_tflops=args.peak_tflops,
        resident=args.act_offload_resident,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``titan-plugins plan``; returns the exit status (2 on bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        as_json = _split(argv)[0].json
        rep = plan_from_argv(argv)
    except PlanError as exc:
        print(f"titan-plugins plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if as_json else render_text(rep))
    return 0
