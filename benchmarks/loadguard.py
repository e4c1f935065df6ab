"""Load guard shared by every benchmark: print the machine's load, withhold verdicts when busy.

A ratio measured while other work competes for the cores says little about the code; each
benchmark prints :func:`describe` in its header and passes every goal through :func:`verdict`,
which states "met" / "NOT met" only when the 1-minute load average is under the threshold
(``--force`` overrides, and says so).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_MAX_LOAD_PER_CORE = 0.75


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--force`` and ``--max-load`` to a benchmark's parser."""
    parser.add_argument(
        "--force", action="store_true", help="state verdicts even when the machine is loaded"
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="1-min load average above which verdicts are withheld "
        f"(default {DEFAULT_MAX_LOAD_PER_CORE} x cores)",
    )


def threshold(args: argparse.Namespace | None = None) -> float:
    """The load above which verdicts are withheld."""
    explicit = getattr(args, "max_load", None) if args is not None else None
    return explicit if explicit is not None else DEFAULT_MAX_LOAD_PER_CORE * (os.cpu_count() or 1)


def load() -> tuple[float, float, float]:
    """``os.getloadavg()`` (zeros where the platform has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def describe(args: argparse.Namespace | None = None) -> str:
    """One header line: load averages, cores and the verdict threshold."""
    one, five, fifteen = load()
    return (
        f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores "
        f"(verdicts withheld above {threshold(args):.2f} unless --force)"
    )


def verdict(met: bool, args: argparse.Namespace | None = None) -> str:
    """``met`` / ``NOT met``, or why no verdict is given (load above the threshold)."""
    one = load()[0]
    if one > threshold(args) and not getattr(args, "force", False):
        return f"no verdict: load {one:.2f} > {threshold(args):.2f} (re-run on a quiet machine or --force)"
    text = "met" if met else "NOT met"
    if one > threshold(args):
        text += f" (forced at load {one:.2f})"
    return text
