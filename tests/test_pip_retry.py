"""scripts/pip_retry.sh: bootstrap tries pip again when the network failed, and only then."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.line_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fake_python(tmp_path: pathlib.Path, outputs: list[tuple[int, str]]) -> pathlib.Path:
    """A stand-in for `python -m pip` that answers each call with the next (status, output)."""
    counter = tmp_path / "calls"
    counter.write_text("0")
    cases = "\n".join(f"  {i}) echo '{text}'; exit {rc} ;;" for i, (rc, text) in enumerate(outputs))
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"n=$(cat {counter}); echo $((n + 1)) > {counter}\n"
        f'case "$n" in\n{cases}\n  *) echo "called too often"; exit 9 ;;\nesac\n'
    )
    script.chmod(0o755)
    return script


def _run(tmp_path: pathlib.Path, python: pathlib.Path) -> tuple[int, int, str]:
    log = tmp_path / "pip.log"
    proc = subprocess.run(
        [
            "bash",
            "-c",
            f'. {ROOT}/scripts/pip_retry.sh; pip_retry "$1" "$2" -q torch',
            "-",
            str(python),
            str(log),
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PIP_RETRY_PAUSE_S": "0"},
    )
    calls = int((tmp_path / "calls").read_text())
    return proc.returncode, calls, proc.stderr


def test_an_incomplete_download_is_tried_again_and_then_succeeds(tmp_path: pathlib.Path) -> None:
    python = _fake_python(
        tmp_path,
        [
            (1, "error: incomplete-download"),
            (1, "ReadTimeoutError: read timed out"),
            (0, "installed"),
        ],
    )
    rc, calls, stderr = _run(tmp_path, python)
    assert (rc, calls) == (0, 3)
    assert stderr.count("the network failed") == 2
    assert "installed" in (tmp_path / "pip.log").read_text()


def test_a_network_failure_gives_up_after_three_tries(tmp_path: pathlib.Path) -> None:
    python = _fake_python(tmp_path, [(1, "error: incomplete-download")] * 3)
    rc, calls, _ = _run(tmp_path, python)
    assert (rc, calls) == (1, 3)


def test_a_resolution_error_fails_at_once(tmp_path: pathlib.Path) -> None:
    # an earlier network error in the same log must not make this try look like one
    (tmp_path / "pip.log").write_text("error: incomplete-download\n")
    python = _fake_python(tmp_path, [(1, "ERROR: No matching distribution found for torch==9")])
    rc, calls, stderr = _run(tmp_path, python)
    assert (rc, calls) == (1, 1)
    assert "network" not in stderr
