"""Ctrl-C during the CPU demo's training is clean: ``scripts/demo.sh``, sent SIGINT as a terminal
sends it (to its whole process group) while the workers train, exits 130 with one line and no
traceback (torchrun forwarded the signal to every worker, each printing a ``KeyboardInterrupt``
traceback, and printed its own), leaves none of the processes it started behind (torchrun's
workers run in sessions of their own) and writes no ``--report``."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "_DEMO_INTERRUPT_TOKEN"
"""In the demo's environment: torchrun, its workers and the filter inherit it, so a process
left behind is found whatever its parent, group or session became."""
MESSAGE = "demo: interrupted; every worker stopped"


def _tagged(token: str) -> list[str]:
    """``pid: command line`` of each living process whose environment holds ``token``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if f"{TOKEN}={token}".encode() not in (
                Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
            ):
                continue
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] not in "ZX":
            found.append(entry.name + ": " + cmdline.replace(b"\0", b" ").decode())
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ctrl_c_during_training_stops_every_worker_in_one_line(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "TITAN_PLUGINS_AUTOLOAD"}
    env.update(
        {TOKEN: token, "PYTHONUNBUFFERED": "1", "NPROC": "4", "MASTER_PORT": str(_free_port())},
        # the line this session's venv holds (test_demo.py: none is installed mid-test)
        MEGATRON_CORE=importlib.metadata.version("megatron-core").split("+")[0],
    )
    report = tmp_path / "report.json"
    log = tmp_path / "output.txt"
    with open(log, "wb") as out:
        demo = subprocess.Popen(
            [str(ROOT / "scripts" / "demo.sh"), "--out", str(tmp_path / "demo"),
             "--report", str(report), "--steps", "200"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 600
    while "layout: " not in log.read_text(errors="replace"):  # rank 0, just before training
        if demo.poll() is not None or time.monotonic() > deadline:
            demo.kill()
            pytest.fail(f"the demo never started training:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    time.sleep(3.0)  # into the training steps
    before = len(log.read_bytes())
    os.killpg(demo.pid, signal.SIGINT)
    try:
        code = demo.wait(timeout=60)
    except subprocess.TimeoutExpired:
        demo.kill()
        pytest.fail(f"the demo still ran 60 s after SIGINT:\n{log.read_text()[-3000:]}")
    left = _tagged(token)
    for _ in range(50):
        if not left:
            break
        time.sleep(0.1)
        left = _tagged(token)
    for line in left:
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    output = log.read_bytes()
    after = output[before:].decode(errors="replace")
    assert code == 130, output.decode(errors="replace")[-3000:]
    assert [line for line in after.splitlines() if line.strip()] == [MESSAGE]
    assert "Traceback" not in output.decode(errors="replace")
    assert left == []
    assert not report.exists()
