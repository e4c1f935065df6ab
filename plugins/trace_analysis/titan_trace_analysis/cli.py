"""``titan-trace``: analyse a directory of per-rank Kineto traces."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import merged_trace, report_html, report_text
from .analyze import Settings, analyze, finish
from .engine import EngineError
from .fastpath import reader_name
from .safe import json_text, safe_text
from .summarize import Options
from .version import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(prog="titan-trace", description=__doc__)
    ap.add_argument(
        "--version",
        action="version",
        version=f"titan-trace {__version__} (reader: {reader_name()})",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="analyse every rank's trace in DIR")
    a.add_argument("trace_dir", metavar="DIR")
    a.add_argument("--out", default="titan-trace-report", help="output folder (JSON, HTML, trace)")
    a.add_argument("--workers", type=int, default=0, help="local processes (default: CPUs)")
    a.add_argument("--engine", choices=("local", "ray"), default="local")
    a.add_argument("--ray-address", default=None, help="Ray cluster address (default: auto)")
    a.add_argument("--slow-threshold", type=float, default=1.10, help="slowdown to report")
    a.add_argument(
        "--window",
        choices=("trace", "hta"),
        default="trace",
        help="trace: every recorded step; hta: drop the last step as HTA 0.5.0 does",
    )
    a.add_argument(
        "--rank-from",
        choices=("auto", "header", "filename"),
        default="auto",
        help="where a trace's rank comes from (auto: header, else the file name)",
    )
    a.add_argument("--ranks-per-node", type=int, default=0, help="nodes without host_name")
    a.add_argument("--pure-python", action="store_true", help="stdlib JSON/gzip (no orjson/isal)")
    a.add_argument("--merged-ranks", type=int, default=64, help="ranks in merged_trace.json")
    a.add_argument("--no-progress", action="store_true")
    a.add_argument("--keep-timelines", action="store_true", help="keep per-rank timelines")
    a.add_argument("--max-ranks", type=int, default=32, help="ranks listed in the terminal")
    return ap


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any] | None, str]:
    """Analyse and write every output; returns (exit code, report, terminal text)."""
    if not os.path.isdir(args.trace_dir):
        return EXIT_USAGE, None, f"titan-trace: {safe_text(args.trace_dir)} is not a directory"
    if args.slow_threshold <= 1.0 or args.slow_threshold != args.slow_threshold:
        return EXIT_USAGE, None, "titan-trace: --slow-threshold must be a number above 1.0"
    os.makedirs(args.out, exist_ok=True)
    settings = Settings(
        engine=args.engine,
        workers=args.workers,
        progress=False if args.no_progress else None,
        slow_threshold=args.slow_threshold,
        ray_address=args.ray_address,
        keep_timelines=args.keep_timelines,
        ranks_per_node=max(0, args.ranks_per_node),
        map=Options(pure=args.pure_python, rank_from=args.rank_from, window=args.window),
    )
    try:
        report = analyze(args.trace_dir, args.out, settings)
    except EngineError as exc:
        return EXIT_USAGE, None, f"titan-trace: {exc}"
    text = report_text.render(report, args.max_ranks)
    merged = os.path.join(args.out, "merged_trace.json")
    merged_trace.write(report, merged, max_ranks=args.merged_ranks)
    with open(os.path.join(args.out, "report.html"), "w") as fh:
        fh.write(report_html.render(report, text))
    finish(report)
    with open(os.path.join(args.out, "report.json"), "w") as fh:
        fh.write(json_text(report))
    text += (
        f"\n\nreports: {safe_text(os.path.join(args.out, 'report.json'))}, report.html, "
        "merged_trace.json (open in https://ui.perfetto.dev)"
    )
    if report["ranks_analyzed"] == 0:
        return EXIT_FAILED, report, text
    return (EXIT_PARTIAL if report["partial"] else EXIT_OK), report, text


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 0 = complete, 3 = partial (problems reported), 1 = nothing analysed."""
    args = build_parser().parse_args(argv)
    code, _report, text = run(args)
    print(text, file=sys.stderr if code == EXIT_USAGE else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
