"""``titan-trace``: analyse a directory of per-rank Kineto traces.

A bad argument (a DIR that is missing or a file, an --out that cannot be a folder we write, a
number out of range) and an output that cannot be written are one line naming the argument or
path and the problem, and exit code 2; a DIR without traces is one line and exit code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from . import merged_trace, report_html, report_text
from .analyze import Settings, analyze, finish
from .discover import find_traces
from .engine import EngineError
from .fastpath import reader_name
from .reader import MAX_EVENT, MAX_STRING, MIB
from .safe import json_text, safe_text
from .summarize import Options
from .version import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL = 0, 1, 2, 3
MAX_MB = 1 << 20  # 1 TiB: more than any file, and what the reader's sizes can hold


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
    a.add_argument(
        "--max-event-mb",
        type=float,
        default=MAX_EVENT / MIB,
        help="refuse a file holding an event larger than this (MiB; default %(default)g)",
    )
    a.add_argument(
        "--max-string-mb",
        type=float,
        default=MAX_STRING / MIB,
        help="drop, counted, an event holding a longer string (MiB; default %(default)g)",
    )
    return ap


def _usage_problem(args: argparse.Namespace) -> str | None:
    """The first bad argument, as the line to print; None when all are usable."""
    d = args.trace_dir
    if not os.path.exists(d):
        return f"titan-trace: DIR {safe_text(d)} does not exist"
    if not os.path.isdir(d):
        what = "is a file" if os.path.isfile(d) else "is not a directory"
        return f"titan-trace: DIR {safe_text(d)} {what}, not a directory of traces"
    if not args.slow_threshold > 1.0:  # NaN fails too
        return "titan-trace: --slow-threshold must be a number above 1.0"
    for flag in ("workers", "merged_ranks", "max_ranks", "ranks_per_node"):
        value = getattr(args, flag)
        if value < 0:
            hint = " (0: one per CPU)" if flag == "workers" else ""
            return f"titan-trace: --{flag.replace('_', '-')} must be 0 or more{hint}, not {value}"
    for flag in ("max_event_mb", "max_string_mb"):
        value = getattr(args, flag)
        if not 0 < value <= MAX_MB:
            return (
                f"titan-trace: --{flag.replace('_', '-')} must be a size in MiB above 0 and at "
                f"most {MAX_MB}, not {value}"
            )
    return None


def _prepare_out(out: str, trace_dir: str) -> str | None:
    """Create the output folder and check that files can be written there; the problem as the
    line to print, or None."""
    shown = f"titan-trace: --out {safe_text(out)}"
    if os.path.realpath(out) == os.path.realpath(trace_dir):
        return (f"{shown} is the trace directory: report.json and merged_trace.json would be "
                "read as traces by the next analysis; choose another folder")  # fmt: skip
    if os.path.exists(out) and not os.path.isdir(out):
        return f"{shown} is a file, not a folder: remove it or choose another path"
    try:
        os.makedirs(out, exist_ok=True)
    except NotADirectoryError:
        return f"{shown}: not a directory (a part of the path is a file)"
    except OSError as exc:
        return f"{shown}: cannot create the folder ({exc.strerror or exc})"
    try:  # root passes os.access everywhere; only a write tells (read-only mounts, /proc)
        fd, probe = tempfile.mkstemp(prefix=".titan-trace-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{shown}: cannot write there ({exc.strerror or exc})"
    return None


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any] | None, str]:
    """Analyse and write every output; returns (exit code, report, terminal text)."""
    problem = _usage_problem(args)
    if problem:
        return EXIT_USAGE, None, problem
    paths, unreadable = find_traces(args.trace_dir)
    if not paths and not unreadable:
        where = safe_text(args.trace_dir)
        return EXIT_FAILED, None, f"titan-trace: no *.json / *.json.gz traces in {where}"
    problem = _prepare_out(args.out, args.trace_dir)
    if problem:
        return EXIT_USAGE, None, problem
    settings = Settings(
        engine=args.engine,
        workers=args.workers,
        progress=False if args.no_progress else None,
        slow_threshold=args.slow_threshold,
        ray_address=args.ray_address,
        keep_timelines=args.keep_timelines,
        ranks_per_node=args.ranks_per_node,
        map=Options(
            pure=args.pure_python,
            rank_from=args.rank_from,
            window=args.window,
            max_event_bytes=int(args.max_event_mb * MIB),
            max_string_bytes=int(args.max_string_mb * MIB),
        ),
    )
    report = None
    try:
        report = analyze(args.trace_dir, args.out, settings)
        text = _write(report, args)
    except EngineError as exc:
        return EXIT_USAGE, None, f"titan-trace: {exc}"
    except OSError as exc:  # the outputs (the traces' own errors are their files' problems)
        where = safe_text(exc.filename or args.out)
        return EXIT_USAGE, None, f"titan-trace: cannot write {where} ({exc.strerror or exc})"
    finally:
        if report is not None:
            finish(report)  # the timelines go, written or not
    text += (
        f"\n\nreports: {safe_text(os.path.join(args.out, 'report.json'))}, report.html, "
        "merged_trace.json (open in https://ui.perfetto.dev)"
    )
    if report["ranks_analyzed"] == 0:
        return EXIT_FAILED, report, text
    return (EXIT_PARTIAL if report["partial"] else EXIT_OK), report, text


def _write(report: dict[str, Any], args: argparse.Namespace) -> str:
    """Write the merged trace, the HTML and the JSON report; returns the terminal text."""
    text = report_text.render(report, args.max_ranks)
    merged = os.path.join(args.out, "merged_trace.json")
    merged_trace.write(report, merged, max_ranks=args.merged_ranks)
    with open(os.path.join(args.out, "report.html"), "w") as fh:
        fh.write(report_html.render(report, text))
    finish(report)  # before the JSON: it drops the report's private keys
    with open(os.path.join(args.out, "report.json"), "w") as fh:
        fh.write(json_text(report))
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 0 = complete, 3 = partial (problems reported), 1 = nothing analysed."""
    args = build_parser().parse_args(argv)
    code, _report, text = run(args)
    print(text, file=sys.stderr if code == EXIT_USAGE else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
