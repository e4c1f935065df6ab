"""``titan-run CMD ...``: run a command with the registry active even where
``TORCH_DEVICE_BACKEND_AUTOLOAD`` is off (it disables every torch.backends extension and is
inherited by children).

It prepends a folder holding a ``sitecustomize`` to ``PYTHONPATH`` and execs the command, so the
command and every Python child that inherits the environment (torchrun workers, multiprocessing
children, a Ray cluster started from it) arm the registry at interpreter start. Our
``sitecustomize`` chains to the one it shadows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "_site"


def launch_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the launched command."""
    env = dict(os.environ if environ is None else environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *parts])
    env["TITAN_RUN"] = "1"
    return env


def main(argv: list[str] | None = None) -> int:
    """Exec ``argv`` (after an optional ``--``) under the titan-run environment."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nusage: titan-run [--] COMMAND [ARGS...]", file=sys.stderr)
        return 0 if args else 2
    try:
        os.execvpe(args[0], args, launch_env())
    except OSError as err:
        print(f"titan-run: cannot run {args[0]!r}: {err}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
