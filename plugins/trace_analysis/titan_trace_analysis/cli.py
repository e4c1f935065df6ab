"""``titan-trace``: analyse a directory of per-rank Kineto traces."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import report_html, report_text
from .analyze import analyze
from .engine import EngineError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(prog="titan-trace", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="analyse every rank's trace in DIR")
    a.add_argument("trace_dir", metavar="DIR")
    a.add_argument("--out", default="titan-trace-report", help="output folder (JSON + HTML)")
    a.add_argument("--workers", type=int, default=0, help="local processes (default: CPUs)")
    a.add_argument("--engine", choices=("local", "ray"), default="local")
    a.add_argument("--ray-address", default=None, help="Ray cluster address (default: auto)")
    a.add_argument("--slow-threshold", type=float, default=1.10, help="slowdown to report")
    a.add_argument("--no-progress", action="store_true")
    a.add_argument("--keep-timelines", action="store_true", help="keep per-rank timelines")
    a.add_argument("--max-ranks", type=int, default=32, help="ranks listed in the terminal")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 0 = complete, 3 = partial (problems reported), 1 = nothing analysed."""
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.trace_dir):
        print(f"titan-trace: {args.trace_dir} is not a directory of traces", file=sys.stderr)
        return EXIT_USAGE
    os.makedirs(args.out, exist_ok=True)
    try:
        report = analyze(
            args.trace_dir,
            args.out,
            engine=args.engine,
            workers=args.workers,
            progress=False if args.no_progress else None,
            slow_threshold=args.slow_threshold,
            ray_address=args.ray_address,
            keep_timelines=args.keep_timelines,
        )
    except EngineError as exc:
        print(f"titan-trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    text = report_text.render(report, args.max_ranks)
    with open(os.path.join(args.out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    with open(os.path.join(args.out, "report.html"), "w") as fh:
        fh.write(report_html.render(report, text))
    print(text)
    print(f"\nreports: {os.path.join(args.out, 'report.json')}, report.html")
    if report["ranks_analyzed"] == 0:
        return EXIT_FAILED
    return EXIT_PARTIAL if report["partial"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
