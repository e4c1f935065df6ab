"""Load guard shared by every benchmark: print the machine's load, withhold verdicts when busy.

A ratio measured while other work competes for the cores says little about the code; each
benchmark prints :func:`describe` in its header and passes every goal through :func:`verdict`,
which states "met" / "NOT met" only when the 1-minute load average is under the threshold
(``--force`` overrides, and says so).  The load that counts is the one before the benchmark's
own work (the first :func:`describe`): a benchmark of two busy processes on two cores raises the
1-minute average to about 2 by itself, which says nothing about other work.  Both are printed.
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


_before: list[float] = []  # the 1-minute load at the first describe(): before our own work


def describe(args: argparse.Namespace | None = None) -> str:
    """One header line: load averages, cores and the verdict threshold (the first call also
    records the load the verdicts are judged on)."""
    one, five, fifteen = load()
    if not _before:
        _before.append(one)
    return (
        f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores "
        f"(verdicts withheld above {threshold(args):.2f} unless --force)"
    )


def verdict(met: bool, args: argparse.Namespace | None = None, unmet: str = "NOT met") -> str:
    """``met`` / ``unmet`` (``NOT met`` unless the benchmark says why it is not), or why no
    verdict is given (load before the run above the threshold; the current load when describe()
    was never called)."""
    one = _before[0] if _before else load()[0]
    when = "before the run" if _before else "now"
    if one > threshold(args) and not getattr(args, "force", False):
        return (
            f"no verdict: load {one:.2f} {when} > {threshold(args):.2f} (re-run on a quiet "
            "machine or --force)"
        )
    text = "met" if met else unmet
    if one > threshold(args):
        text += f" (forced at load {one:.2f} {when})"
    return text
