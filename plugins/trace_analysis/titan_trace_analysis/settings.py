"""The capture's knobs, declared once and read only through :meth:`Setting.read`.

Analysis options are command-line flags of ``titan-trace``, not environment variables.
"""

from __future__ import annotations

from titan_plugins.settings import Setting


def parse_steps(text: str) -> tuple[int, int] | None:
    """``"10-12"`` -> (10, 12), ``"7"`` -> (7, 7), ``""`` -> None; ValueError names the form."""
    text = text.strip()
    if not text:
        return None
    lo, sep, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError("use FIRST-LAST or N, e.g. 10-12") from None
    if first < 0 or last < first:
        raise ValueError("need 0 <= FIRST <= LAST, e.g. 10-12")
    return first, last


def _steps_problem(text: str) -> str | None:
    try:
        parse_steps(text)
    except ValueError as exc:
        return str(exc)
    return None


STEPS = Setting(
    "TITAN_TRACE_STEPS",
    str,
    "",
    "Iterations to trace on every rank: FIRST-LAST or N (unset: no capture).",
    validate=_steps_problem,
    default_text="unset",
)
DIR = Setting(
    "TITAN_TRACE_DIR",
    str,
    "titan_traces",
    "Folder for rank-<R>.json.gz (use shared storage for multi-node jobs).",
)
GZIP = Setting("TITAN_TRACE_GZIP", bool, True, "1: write gzipped traces; 0: plain JSON.")

SETTINGS = [STEPS, DIR, GZIP]
