"""One-command GPU check: every plugin's GPU section, one table, one JSON file.

Each section is a benchmark of ``benchmarks/`` run as ``--section gpu`` in its own process (a
crash or hang in one never hides the others), with a time limit; the section prints one line
``GPU_CHECK_RESULT {json}`` with its figures, which this script gathers. The whole check is
sized for about 8 minutes on one GPU; the two-rank sections run two processes sharing it.

``--dry-run`` runs the same sections tiny on CPU (``--gpu-smoke``): CI runs it, so the GPU path
cannot rot between the rare runs on a GPU machine::

    ./scripts/gpu_check.sh              # on a GPU machine; writes gpu_check.json
    ./scripts/gpu_check.sh --dry-run    # anywhere (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import loadguard

HERE = Path(__file__).resolve().parent
MARK = "GPU_CHECK_RESULT "


@dataclass(frozen=True)
class Section:
    """One plugin's GPU section: which benchmark, its extra arguments, its time limit."""

    plugin: str
    script: str
    args: tuple[str, ...] = ()
    timeout_s: int = 120
    what: str = ""


SECTIONS = (
    Section(
        "fp8_blockwise",
        "fp8_blockwise.py",
        timeout_s=90,
        what="blockwise FP8 GEMM step vs bf16 (TE recipe when TE imports, else the torch path)",
    ),
    Section(
        "act_offload",
        "act_offload.py",
        timeout_s=90,
        what="1F1B stage emulation with pinned buffers and copy streams: step time and peak memory",
    ),
    Section(
        "moe_ep_overlap",
        "moe_ep_overlap.py",
        timeout_s=120,
        what="EP=2 (two processes sharing one GPU over gloo; NCCL with >= 2 GPUs) chunked overlap vs serial",
    ),
    Section(
        "pp_rdma",
        "pp_rdma.py",
        timeout_s=120,
        what="CUDA tensors between two processes: torch P2P fallback and Mooncake TCP",
    ),
    Section(
        "trace_analysis",
        "trace_analysis.py",
        timeout_s=60,
        what="capture of a step with CUDA activity, then the analyzer on it",
    ),
    Section(
        "rewind",
        "rewind.py",
        timeout_s=60,
        what="snapshot (pinned host, side stream) and restore of a GPU model: overhead, bytes",
    ),
)


@dataclass
class Outcome:
    """What one section did."""

    plugin: str
    status: str  # ok | failed | timeout | no result
    seconds: float
    result: dict = field(default_factory=dict)
    tail: str = ""


def emit(result: dict) -> None:
    """Called by a benchmark's GPU section: print its figures for :func:`run_section`."""
    print(MARK + json.dumps(result, default=str), flush=True)


def run_section(section: Section, smoke: bool) -> Outcome:
    """Run one section in its own process and read its result line."""
    command = [sys.executable, str(HERE / section.script), "--section", "gpu", *section.args]
    if smoke:
        command.append("--gpu-smoke")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_COMPILE_DISABLE": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=section.timeout_s, env=env
        )
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        return Outcome(section.plugin, "timeout", time.perf_counter() - started, tail=out[-2000:])
    seconds = time.perf_counter() - started
    text = done.stdout + done.stderr
    results = [line[len(MARK) :] for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0:
        return Outcome(section.plugin, "failed", seconds, tail=text[-2000:])
    if not results:
        return Outcome(section.plugin, "no result", seconds, tail=text[-2000:])
    return Outcome(section.plugin, "ok", seconds, result=json.loads(results[-1]))


def table(outcomes: list[Outcome]) -> str:
    """The results as one text table: plugin, status, seconds, figures."""
    lines = [f"{'plugin':<16} {'status':<10} {'seconds':>8}  figures"]
    for outcome in outcomes:
        figures = ", ".join(f"{k}={_fmt(v)}" for k, v in outcome.result.items())
        lines.append(
            f"{outcome.plugin:<16} {outcome.status:<10} {outcome.seconds:>8.1f}  {figures}"
        )
    return "\n".join(lines)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run of every section")
    parser.add_argument("--json", default="gpu_check.json", help="where to write the results")
    parser.add_argument("--only", nargs="*", default=None, help="plugins to check (default all)")
    loadguard.add_arguments(parser)
    args = parser.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        print("gpu_check: no CUDA device here; run on a GPU machine, or --dry-run on CPU")
        return 2
    print(loadguard.describe(args))
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (dry run on CPU)"
    print(f"gpu_check: device {gpu}, torch {torch.__version__}")
    outcomes = []
    for section in SECTIONS:
        if args.only and section.plugin not in args.only:
            continue
        print(f"[{section.plugin}] {section.what} ...", flush=True)
        outcome = run_section(section, smoke=args.dry_run)
        print(f"[{section.plugin}] {outcome.status} in {outcome.seconds:.1f} s", flush=True)
        if outcome.status != "ok":
            print(outcome.tail, flush=True)
        outcomes.append(outcome)
    print()
    print(table(outcomes))
    payload = {
        "device": gpu,
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "load": loadguard.load(),
        "sections": [asdict(o) for o in outcomes],
    }
    Path(args.json).write_text(json.dumps(payload, indent=2, default=str))
    print(f"\nwritten {args.json}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
