"""Fresh virtual environments for installed-distribution tests.

Building a venv with torch and megatron-core from scratch costs minutes and gigabytes, so the
fresh venv links the heavy third-party packages of the current environment through a filtered
folder (everything except Titan distributions and editable-install finders) and then installs the
distributions under test into it for real, with pip, non-editable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

EXCLUDED_PREFIXES = ("titan", "_titan", "__editable__", "__pycache__")


def _is_excluded(name: str, extra: Sequence[str] = ()) -> bool:
    lowered = name.lower()
    return lowered.startswith((*EXCLUDED_PREFIXES, *extra)) or lowered.endswith(".pth")


def make_venv(path: Path, base_site: str | None = None, exclude: Sequence[str] = ()) -> Path:
    """Create a venv at ``path`` that sees the current environment's third-party packages
    but no Titan distribution; return its python executable.

    :param exclude: more name prefixes (lower case) to leave out of the linked packages, e.g.
        ``("megatron",)`` for a venv with no megatron-core distribution.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    source = Path(base_site or sysconfig.get_paths()["purelib"])
    linked = path / "base-site"
    linked.mkdir()
    for entry in source.iterdir():
        if not _is_excluded(entry.name, exclude):
            (linked / entry.name).symlink_to(entry)
    # A path line (not a site dir): .pth files inside base-site are deliberately not run.
    (site / "zz_titan_test_base.pth").write_text(f"{linked}\n")
    return python


def pip_install(python: Path, *projects: Path | str, editable: bool = False) -> None:
    """Install ``projects`` into the venv of ``python`` with the current pip, no network."""
    command = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    command += ["--no-deps", "--no-build-isolation", "--no-index"]
    for project in projects:
        command += ["-e", str(project)] if editable else [str(project)]
    subprocess.run(command, check=True, capture_output=True, text=True)


def clean_env(extra: dict[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """The current environment without TITAN_* / autoload switches, plus ``extra``. The test
    session's ``line_independent`` probe stays (``line_guard``): it watches, it switches nothing."""
    from titan_plugins.testing.line_guard import PROBE_DIR, RECORD_DIR_VAR

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TITAN_")
        and k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH", *drop)
    }
    env.update(extra or {})
    if os.environ.get(RECORD_DIR_VAR):
        env[RECORD_DIR_VAR] = os.environ[RECORD_DIR_VAR]
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([*rest, str(PROBE_DIR)])
    return env
