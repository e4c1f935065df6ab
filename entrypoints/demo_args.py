"""The CPU demo's arguments and port, checked before any worker starts.

``scripts/demo.sh`` runs these checks once, through :func:`demo_layout.preflight` and
``demo_args.py master-port``, so a bad value is one line naming the fix and exit 2, not a whole
training run that ends in a traceback per rank (or silently does nothing). Standard library only:
it runs before the venv may exist.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import tempfile
from collections.abc import Mapping

DEFAULT_TRACE_STEPS = (2, 3)  # past the first steps' warm-up, two steps to compare


class DemoArgsError(ValueError):
    """A demo argument (or MASTER_PORT) that cannot work: one line, naming the fix."""


def check(args: argparse.Namespace) -> None:
    """Check the demo's options and fill in ``args.trace_steps`` when it was left out.

    Steps are numbered as the demo prints them, from 0 to ``--steps`` - 1 (the rewind and
    trace knobs count the same way), so a fault or trace step outside them would never happen.
    Raises :class:`DemoArgsError`.
    """
    steps = args.steps
    if steps < 1:
        raise DemoArgsError(f"demo: --steps {steps}: train at least one step (--steps 1 or more)")
    last = steps - 1
    if args.inject_fault is not None and not 0 <= args.inject_fault <= last:
        raise DemoArgsError(
            f"demo: --inject-fault {args.inject_fault} is not a step of this run (--steps {steps} "
            f"trains steps 0 to {last}); pick a step from 0 to {last}"
        )
    args.trace_steps = trace_steps(args.trace_steps, steps)
    if args.report is not None:
        check_report_path(args.report)


def trace_steps(text: str | None, steps: int) -> str:
    """The trace window to capture: ``text`` checked against the run's steps, or (left out) the
    default 2-3 moved back to the run's last two steps when the run is shorter. A window past
    the last step never closes: its traces are not written and each rank fails at exit."""
    last = steps - 1
    if text is None:
        first, end = DEFAULT_TRACE_STEPS
        if end > last:
            first, end = max(0, last - 1), last
        return str(end) if first == end else f"{first}-{end}"
    if text == "none":
        return text
    lo, sep, hi = text.partition("-")
    try:
        first, end = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        first, end = -1, -1
    if not 0 <= first <= end:
        raise DemoArgsError(
            f"demo: --trace-steps {text}: use FIRST-LAST or N (e.g. 2-3), or 'none'"
        )
    if end > last:
        raise DemoArgsError(
            f"demo: --trace-steps {text} goes past the run's last step {last} (--steps {steps}); "
            f"pick steps from 0 to {last}, or raise --steps"
        )
    return text


def check_report_path(path: str) -> None:
    """Whether the JSON report can be written at ``path``: its folder exists and takes a new
    file (tried for real, as root ignores permission bits), and ``path`` is not a folder."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise DemoArgsError(
            f"demo: --report {path} is a directory; name a file, e.g. --report "
            f"{os.path.join(path, 'report.json')}"
        )
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise DemoArgsError(
            f"demo: --report {path}: {folder} is a file, not a folder; name a file in a folder"
        )
    if not os.path.isdir(folder):
        raise DemoArgsError(
            f"demo: --report {path}: the folder {folder} does not exist; create it "
            f"(mkdir -p {folder}) or name a file in an existing folder"
        )
    try:  # the report is written as a temporary file in this folder, then renamed
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".titan-demo-report-"):
            pass
    except OSError as err:
        raise DemoArgsError(
            f"demo: --report {path}: cannot write in {folder} ({err.strerror}); "
            "name a file in a folder you can write"
        ) from None


def master_port(environ: Mapping[str, str]) -> int:
    """The port torchrun's rendezvous listens on: ``MASTER_PORT`` when set (refused in one line
    when it is not a port or something already listens there), else a free one the kernel picks
    (so two demos at once do not collide on a fixed default)."""
    text = environ.get("MASTER_PORT", "").strip()
    if not text:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise DemoArgsError(
            f"demo: MASTER_PORT={text} is not a port (1-65535); unset it to let the demo pick a "
            "free one"
        )
    port = int(text)
    with socket.socket() as sock:
        # As torchrun's store does: a port left in TIME_WAIT by an ended job is free to reuse.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise DemoArgsError(
                    f"demo: MASTER_PORT={port}: cannot listen there ({err.strerror}); "
                    "set another port, or unset MASTER_PORT to let the demo pick a free one"
                ) from None
            raise DemoArgsError(
                f"demo: MASTER_PORT={port} is busy (another demo or job listens there); set "
                "another port, or unset MASTER_PORT to let the demo pick a free one"
            ) from None
    return port


def main(argv: list[str]) -> int:
    """``demo_args.py master-port``: print the port to use and return 0, or one line, 2."""
    if argv != ["master-port"]:
        print("usage: demo_args.py master-port", file=sys.stderr)
        return 2
    try:
        print(master_port(os.environ))
    except DemoArgsError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
