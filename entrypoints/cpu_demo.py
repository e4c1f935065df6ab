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
import os
import sys
import time
from typing import Any

from titan_entrypoints import demo_output
from titan_entrypoints.demo_args import DemoArgsError, check
from titan_entrypoints.demo_layout import Layout, LayoutError, resolve

DEFAULT_OUT = "demo_out"
EXPERTS = 4  # tiny_gpt.make_config's (and make_kimi_config's) num_moe_experts
# --model: tiny_gpt.MODELS' names (this module is imported before torch may exist, by
# demo_layout.preflight; test_harness_mla checks the two agree)
MODELS = ("gpt", "kimi")


def _feature_overrides(enabled: set[str], layout: Layout) -> dict:
    """Megatron config that exercises the enabled plugins (none of these flags is Titan's own).

    The flex dispatcher (the path moe_ep_overlap serves) only where Megatron accepts it: its
    ``MoEFlexTokenDispatcher`` refuses TP x EP = 1, and then the demo keeps alltoall (the plugin
    reports that it stepped aside)."""
    overrides: dict = {}
    if "fp8_blockwise" in enabled:
        overrides.update(fp8="e4m3", fp8_recipe="blockwise")
    if "moe_ep_overlap" in enabled and layout.tp_x_ep > 1:
        overrides.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    return overrides


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The demo's options (``--help``); a layout size left out is chosen to fit the processes."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # scripts/demo.sh rewrites the layout flags by their full names
    )  # fmt: skip
    parser.add_argument(
        "--pp", type=int, default=None,
        help="pipeline-parallel size (default: 2 when the processes allow it)",
    )  # fmt: skip
    parser.add_argument(
        "--ep", type=int, default=None,
        help="expert-parallel size (default: 2 with 4 processes, else 1 when PP=2 fits)",
    )  # fmt: skip
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="gpt",
        help="gpt: a Mixtral-style MoE GPT (standard attention, softmax top-2); kimi: Kimi-K2's "
        "architecture at tiny size (multi-latent attention, a dense first layer, one shared "
        "expert, a sigmoid router with expert bias and group-limited routing, RMSNorm, SwiGLU)",
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps (1 or more)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--hidden", type=int, default=128, help="hidden size (FP8 tiles are 128 wide)"
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for traces and the report")
    parser.add_argument(
        "--trace-steps",
        default=None,
        help="training steps the trace_analysis plugin captures (TITAN_TRACE_STEPS; default "
        "2-3, or the last two steps of a shorter run), 'none' to capture nothing",
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
        "to watch rewind roll back and go on; steps count from 0, as printed",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show every line the libraries print (scripts/demo.sh otherwise leaves out their "
        "start-up chatter, entrypoints/demo_noise.py)",
    )
    return parser.parse_args(argv)


def _demo_environment(args: argparse.Namespace) -> None:
    """Plugin knobs the demo chooses, set before megatron is imported (activation reads them).
    A value the user exported wins."""
    if args.trace_steps != "none":
        os.environ.setdefault("TITAN_TRACE_STEPS", args.trace_steps)
        if "TITAN_TRACE_DIR" not in os.environ:
            os.environ["TITAN_TRACE_DIR"] = os.path.join(args.out, "traces")
            os.environ["_TITAN_DEMO_OWNS_TRACE_DIR"] = "1"
    if args.inject_fault is not None:
        os.environ["TITAN_REWIND_INJECT_NAN_STEP"] = str(args.inject_fault)


def main() -> None:
    """One demo worker (torchrun starts one per process): train, then report what each plugin did."""
    args = parse_args()
    try:  # scripts/demo.sh checked them already; a direct torchrun run is checked here
        check(args)
    except DemoArgsError as err:
        if os.environ.get("RANK", "0") == "0":
            print(err, file=sys.stderr, flush=True)
        sys.exit(2)
    _demo_environment(args)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    import torch

    torch.set_num_threads(1)
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:  # scripts/demo.sh resolved it already; a direct torchrun run is checked here
        layout = resolve(dist.get_world_size(), args.pp, args.ep, args.vpp, EXPERTS)
    except LayoutError as err:
        if rank == 0:
            print(err, file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(2)

    if rank == 0 and os.environ.get("_TITAN_DEMO_OWNS_TRACE_DIR"):
        _clear_old_traces(os.environ["TITAN_TRACE_DIR"])
    dist.barrier()  # no rank writes a trace before the old ones are gone

    import megatron.core  # noqa: F401  # the registry activates here (torch.backends channel)

    from titan_plugins import report
    from titan_plugins.errors import JobStopped
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    data = report.collect()
    enabled = {p["name"] for p in data["plugins"] if p["state"] == "enabled"}
    tiny_gpt.init_parallel(pp=layout.pp, ep=layout.ep, vpp=layout.vpp)
    cfg = tiny_gpt.model_config(
        args.model,
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        **_feature_overrides(enabled, layout),
    )
    chunks = tiny_gpt.build_model(cfg, vpp=layout.vpp, **tiny_gpt.MODELS[args.model].gpt_kwargs)
    if rank == 0:
        print(
            f"model: {args.model}, {cfg.num_layers} layers; layout: {' '.join(layout.flags())} "
            f"on {dist.get_world_size()} processes"
        )
        demo_output.print_report(report.collect())
    started = time.perf_counter()
    try:
        losses, grad_norms = tiny_gpt.train(
            chunks, cfg, steps=args.steps, num_microbatches=args.microbatches
        )
    except JobStopped as err:  # a plugin stopped the job on purpose: one message, no tracebacks
        if err.primary:
            print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
        # Every rank raised in the same step: wait for rank 0's message before any rank ends
        # (torchrun stops the others, rank 0 included, when the first one exits).
        dist.barrier()
        _exit(err.exit_code)
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
    written = True
    if rank == 0:
        print(demo_output.effects_table(effects), flush=True)
        if args.report:
            written = demo_output.write_report(args.report, effects, report.collect())
    dist.barrier()  # every rank has written its trace before rank 0 reads them
    if rank == 0 and args.trace_steps != "none" and "trace_analysis" in enabled:
        print(demo_output.trace_summary(os.environ["TITAN_TRACE_DIR"]), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not written:
        sys.exit(1)


def _clear_old_traces(trace_dir: str) -> None:
    """Remove an earlier demo run's per-rank traces from the demo's own trace folder: the analyzer
    reads every rank file there, and a 4-rank run's files would be mixed into a 2-rank run's."""
    import glob

    for path in glob.glob(os.path.join(trace_dir, "rank-*.json*")):
        os.unlink(path)


def _exit(code: int) -> None:
    """End this worker with ``code`` and no traceback; under ``scripts/demo.sh``
    (``TITAN_DEMO_STATUS``) exit 0 after writing the code there, so torchrun does not add its
    own per-worker failure report, and demo.sh exits with it."""
    import torch.distributed as dist

    status = os.environ.get("TITAN_DEMO_STATUS")
    if status:
        with open(f"{status}.{dist.get_rank()}", "w") as out:
            out.write(str(code))
    sys.stdout.flush()
    sys.stderr.flush()
    # Peers stopped at the same collective decision; the process group is not torn down
    # (a gloo peer may already be gone), the process simply ends.
    os._exit(0 if status else code)


if __name__ == "__main__":
    main()
