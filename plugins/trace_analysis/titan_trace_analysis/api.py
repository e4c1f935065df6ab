"""One call for programs that want the analysis of a trace directory as text (the CPU demo).

:func:`summarize_dir` never raises: whatever goes wrong comes back as text.
"""

from __future__ import annotations

import os


def summarize_dir(
    trace_dir: str, out_dir: str | None = None, workers: int = 1, max_ranks: int = 16
) -> str:
    """Analyse ``trace_dir`` like ``titan-trace analyze`` and return the terminal summary.

    Writes report.json, report.html and merged_trace.json into ``out_dir`` (default:
    ``<trace_dir>/report``); the summary's last line names the HTML report (``HTML report:
    <path>``) when it was written.  Never raises.
    """
    try:
        from . import cli

        out = out_dir or os.path.join(trace_dir, "report")
        args = cli.build_parser().parse_args(
            ["analyze", trace_dir, "--out", out, "--workers", str(max(1, workers)),
             "--no-progress", "--max-ranks", str(max_ranks)]
        )  # fmt: skip
        _code, report, text = cli.run(args)
        if report is not None:
            text += f"\nHTML report: {os.path.abspath(os.path.join(out, 'report.html'))}"
        return text
    except (Exception, SystemExit) as exc:  # the demo must finish whatever happens here
        return f"titan-trace: analysis failed ({type(exc).__name__}: {exc})"


def html_path(text: str) -> str | None:
    """The HTML report path named by a :func:`summarize_dir` summary, if any."""
    for line in reversed(text.splitlines()):
        if line.startswith("HTML report: "):
            return line[len("HTML report: ") :]
    return None
