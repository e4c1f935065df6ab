"""The capture's knobs, declared once and read only through :meth:`Setting.read`.

Analysis options are command-line flags of ``titan-trace``, not environment variables.
"""

from __future__ import annotations

import os

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


def dir_problem(path: str) -> str | None:
    """Why ``path`` cannot hold the traces (a file, or a folder this process can neither create
    nor write), or None when it can.

    Run at activation (the Setting's check), so the user hears it before training, not when the
    first trace is written after the traced steps. It stats the path and its nearest existing
    parent and creates nothing: activation runs in every process, traced or not.
    """
    target = os.path.abspath(path)
    probe = target
    while not os.path.lexists(probe):  # walk up to what exists (the folder is made at export)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    fix = "name a folder this process can create or write"
    if not os.path.isdir(probe):
        if probe == target:
            return f"{target} exists and is not a folder: {fix}"
        return f"{target} cannot be created: {probe} is not a folder: {fix}"
    if not os.access(probe, os.W_OK | os.X_OK):
        if probe == target:
            return f"the folder {target} is not writable by this process: {fix}"
        return f"{target} cannot be created: {probe} is not writable by this process: {fix}"
    return None


DIR = Setting(
    "TITAN_TRACE_DIR",
    str,
    "titan_traces",
    "Folder for rank-<R>.json.gz (use shared storage for multi-node jobs); a file or a folder "
    "this process cannot create or write is named at activation.",
    validate=dir_problem,
)
GZIP = Setting("TITAN_TRACE_GZIP", bool, True, "1: write gzipped traces; 0: plain JSON.")

SETTINGS = [STEPS, DIR, GZIP]
