"""Ctrl-C during ``titan-plugins verify`` is clean: sent as a terminal sends it (SIGINT to the
whole process group) during start-up, during the differential runs and during the upstream
tests, verify exits 130 within seconds with one line and no traceback, leaves no process behind
(the fork server, the resource tracker, the workers, the upstream ranks: the issue 46 probe found
``multiprocessing.forkserver`` and ``resource_tracker`` orphaned in 5 of 10 tries) and writes no
``--json`` file, whole or partial. And its printed output holds none of the native libraries'
start-up chatter."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_plugins import native_noise

pytestmark = pytest.mark.multiprocess

TOKEN = "_VERIFY_INTERRUPT_TOKEN"
"""Set in the verify run's environment: every process it starts inherits it (the fork server
and the workers it forks, the spawned tracker, the upstream ranks), so a process left behind is
found whatever its parent or group became."""
FORK_SERVER = "multiprocessing.forkserver"
UPSTREAM_RANK = "titan_plugins.testing.upstream_worker"
STOPPED_WITHIN_S = 30.0  # the probe saw the parent still running 20 s after SIGINT
MESSAGE = "titan-plugins verify: interrupted; every worker stopped, nothing written"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    cmdline: str


def _tagged(token: str) -> list[Proc]:
    """The living processes whose environment holds ``token``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
            if f"{TOKEN}={token}".encode() not in environ.split(b"\0"):
                continue
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:  # ended while we looked, or not ours
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state not in ("Z", "X"):
            found.append(
                Proc(int(entry.name), int(ppid), state, cmdline.replace(b"\0", b" ").decode())
            )
    return found


class Run:
    """``titan-plugins verify ARGS --json <empty folder>/v.json`` in its own session, as from a
    terminal: a SIGINT to its process group reaches every process in it."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.token = uuid.uuid4().hex
        self.log = tmp_path / "output.txt"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "titan_plugins.cli", "verify", *args,
                 "--json", str(self.out / "v.json")],
                env={**os.environ, TOKEN: self.token},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def fail(self, why: str) -> None:
        """Fail, leaving nothing of this run behind."""
        self.proc.kill()
        self.proc.wait()
        for proc in _tagged(self.token):
            os.kill(proc.pid, signal.SIGKILL)
        pytest.fail(f"{why}:\n{self.output()[-3000:]}")

    def wait_for(self, what: str, found: Callable[[list[Proc]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"verify ended before {what}")
            if found(_tagged(self.token)):
                return
            time.sleep(0.25)
        self.fail(f"no {what} within {timeout:.0f} s")

    def interrupt_and_check(self) -> None:
        """Ctrl-C now; then every promise of a clean stop: after it, one line."""
        before = len(self.log.read_bytes())  # what the run printed before (its warnings)
        sent = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.fail("verify still ran 120 s after SIGINT")
        took = time.monotonic() - sent
        left = _tagged(self.token)
        for _ in range(50):  # a process killed just now may take a moment to be gone
            if not left:
                break
            time.sleep(0.1)
            left = _tagged(self.token)
        for proc in left:  # the test leaves nothing behind either
            os.kill(proc.pid, signal.SIGKILL)
        output = self.output()
        after = self.log.read_bytes()[before:].decode(errors="replace")
        assert code == 130, output[-3000:]
        assert [line for line in after.splitlines() if line.strip()] == [MESSAGE], output
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        assert took < STOPPED_WITHIN_S, f"{took:.1f} s from SIGINT to exit"
        assert left == [], "\n".join(
            f"left running: pid {p.pid} (parent {p.ppid}, {p.state}): {p.cmdline}" for p in left
        )
        assert list(self.out.iterdir()) == []  # no verdict, no temporary file


def _fork_server(procs: list[Proc]) -> Proc | None:
    """The fork server: the process running forkserver's main whose parent is not one."""
    servers = [p for p in procs if FORK_SERVER in p.cmdline]
    pids = {p.pid for p in servers}
    return next((p for p in servers if p.ppid not in pids), None)


def _workers(procs: list[Proc]) -> list[Proc]:
    """The gloo workers the fork server forked (they carry its command line)."""
    server = _fork_server(procs)
    return [p for p in procs if server and p.ppid == server.pid]


def test_ctrl_c_while_the_fork_server_starts_stops_it_and_the_tracker(tmp_path) -> None:
    run = Run(tmp_path, "--only", "act_offload", "--layouts", "pp2xep2")
    run.wait_for("fork server", lambda procs: _fork_server(procs) is not None, timeout=300)
    run.interrupt_and_check()  # the server is still importing megatron


def test_ctrl_c_during_the_differential_runs_stops_every_worker(tmp_path) -> None:
    run = Run(tmp_path, "--only", "act_offload", "--layouts", "pp2xep2")
    run.wait_for("4 forked workers", lambda procs: len(_workers(procs)) >= 4, timeout=600)
    # the workers do not take the Ctrl-C themselves: started shielded, SIGINT stays blocked
    for worker in _workers(_tagged(run.token)):
        blocked = next(
            line.split()[1]
            for line in Path(f"/proc/{worker.pid}/status").read_text().splitlines()
            if line.startswith("SigBlk:")
        )
        assert int(blocked, 16) & (1 << (signal.SIGINT - 1)), (worker, blocked)
    time.sleep(3.0)  # into the first run's start-up and training
    run.interrupt_and_check()


def _checkout(root: Path) -> Path:
    """A Megatron-LM checkout: the installed megatron, and at a path the core's data file selects
    (the core's optimizer-step patch, which rewind acts through) a test that runs for minutes."""
    spec = importlib.util.find_spec("megatron")
    assert spec is not None and spec.submodule_search_locations
    tests = root / "tests" / "unit_tests"
    tests.mkdir(parents=True)
    (root / "megatron").symlink_to(Path(list(spec.submodule_search_locations)[0]))
    (root / "tests" / "__init__.py").write_text("")
    (tests / "__init__.py").write_text("")
    (tests / "test_optimizer.py").write_text(
        "import time\n\n\ndef test_takes_minutes():\n    time.sleep(600)\n"
    )
    return root


def test_ctrl_c_during_the_upstream_tests_stops_every_rank(tmp_path) -> None:
    checkout = _checkout(tmp_path / "Megatron-LM")
    run = Run(
        tmp_path, "--megatron-lm", str(checkout), "--only", "rewind", "--world-sizes", "1",
        "--layouts", "pp2xep2",
    )  # fmt: skip
    run.wait_for(
        "upstream rank", lambda procs: any(UPSTREAM_RANK in p.cmdline for p in procs), timeout=300
    )
    time.sleep(3.0)  # into the rank's start-up and its test
    run.interrupt_and_check()


def test_verify_prints_none_of_the_native_libraries_start_up_chatter(tmp_path) -> None:
    # trace_analysis captures a trace in every run (Kineto's USDT lines on each rank), and every
    # worker builds the GPTModel (Megatron's deprecation notice) and imports torch's
    # cpp_extension (its "No CUDA runtime" warning): the lines the issue 46 probe saw
    run = Run(tmp_path, "--only", "trace_analysis", "--layouts", "pp2xep2")
    code = run.proc.wait(timeout=1800)
    output = run.output()
    assert code == 0, output[-4000:]
    assert "verdict: PASS" in output
    chatter = [line for line in output.splitlines() if native_noise.why_noise(line)]
    assert chatter == []
    assert "lines of native libraries' start-up chatter left out; --verbose shows them" in output
    assert _tagged(run.token) == []  # a normal end stops the fork server and the tracker too


def test_the_json_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    from titan_plugins.verify import cli

    target = tmp_path / "v.json"

    def interrupted(*args: object) -> None:  # a Ctrl-C between the write and the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.write_whole(str(target), '{"verdict": "PASS"}\n')
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary one
    monkeypatch.undo()
    cli.write_whole(str(target), '{"verdict": "PASS"}\n')
    assert list(tmp_path.iterdir()) == [target]
    assert target.read_text() == '{"verdict": "PASS"}\n'
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain write makes it
