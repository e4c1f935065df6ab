"""The CPU demo's arguments, port and output, judged without training: bad values are refused in
one line with exit 2 before any worker starts (``scripts/demo.sh`` stops in its preflight, before
bootstrap and torchrun), only this run's trace report is named, and the native libraries'
start-up chatter is dropped line by line while real warnings and tracebacks pass.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from titan_entrypoints import demo_args, demo_layout, demo_noise, demo_output
from titan_entrypoints.cpu_demo import parse_args
from titan_entrypoints.demo_args import DemoArgsError

pytestmark = pytest.mark.line_independent

ROOT = Path(__file__).resolve().parents[1]


def _checked(*argv: str) -> argparse.Namespace:
    args = parse_args(list(argv))
    demo_args.check(args)
    return args


def _refused(*argv: str) -> str:
    with pytest.raises(DemoArgsError) as err:
        _checked(*argv)
    message = str(err.value)
    assert "\n" not in message
    return message


def _demo_sh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``scripts/demo.sh ARGS``; every call here must stop before bootstrap (a test fails, not
    hangs, if one went on: the timeout is far below an install or a training run)."""
    environ = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    environ.update(env or {})
    return subprocess.run(
        [str(ROOT / "scripts" / "demo.sh"), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


# ------------------------------------------------------------------------- steps and faults


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_steps_below_one_are_refused(steps: str) -> None:
    assert _refused("--steps", steps) == (
        f"demo: --steps {steps}: train at least one step (--steps 1 or more)"
    )


@pytest.mark.parametrize("step", ["999", "-1", "30"])
def test_a_fault_step_outside_the_run_is_refused(step: str) -> None:
    """Steps count from 0 as printed, so with the default 30 steps, step 30 never runs either."""
    assert _refused("--inject-fault", step) == (
        f"demo: --inject-fault {step} is not a step of this run (--steps 30 trains steps 0 to "
        "29); pick a step from 0 to 29"
    )


def test_fault_steps_of_the_run_pass() -> None:
    assert _checked("--steps", "4", "--inject-fault", "0").inject_fault == 0
    assert _checked("--steps", "4", "--inject-fault", "3").inject_fault == 3


# ------------------------------------------------------------------------------ trace steps


@pytest.mark.parametrize(
    ("steps", "window"), [("30", "2-3"), ("4", "2-3"), ("3", "1-2"), ("2", "0-1"), ("1", "0")]
)
def test_the_default_trace_window_fits_a_short_run(steps: str, window: str) -> None:
    """A window past the last step never closes (with ``--steps 2`` the default 2-3 wrote no
    trace and every rank printed a traceback at exit)."""
    assert _checked("--steps", steps).trace_steps == window


def test_a_trace_window_past_the_run_or_malformed_is_refused() -> None:
    assert _refused("--steps", "2", "--trace-steps", "2-3") == (
        "demo: --trace-steps 2-3 goes past the run's last step 1 (--steps 2); pick steps from 0 "
        "to 1, or raise --steps"
    )
    assert _refused("--trace-steps", "3-x") == (
        "demo: --trace-steps 3-x: use FIRST-LAST or N (e.g. 2-3), or 'none'"
    )
    assert _checked("--steps", "2", "--trace-steps", "none").trace_steps == "none"
    assert _checked("--steps", "8", "--trace-steps", "5-7").trace_steps == "5-7"


# ----------------------------------------------------------------------------------- report


def test_a_report_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    assert _refused("--report", str(tmp_path)) == (
        f"demo: --report {tmp_path} is a directory; name a file, e.g. --report "
        f"{tmp_path / 'report.json'}"
    )


def test_a_report_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "report.json"
    assert _refused("--report", str(path)) == (
        f"demo: --report {path}: the folder {path.parent} does not exist; create it "
        f"(mkdir -p {path.parent}) or name a file in an existing folder"
    )
    (tmp_path / "file").write_text("")
    assert _refused("--report", str(tmp_path / "file" / "r.json")) == (
        f"demo: --report {tmp_path / 'file' / 'r.json'}: {tmp_path / 'file'} is a file, not a "
        "folder; name a file in a folder"
    )


def test_a_report_in_an_unwritable_folder_is_refused() -> None:
    """sysfs takes no new file, not even from root (which ignores permission bits)."""
    assert _refused("--report", "/sys/report.json") == (
        "demo: --report /sys/report.json: cannot write in /sys (Permission denied); name a file "
        "in a folder you can write"
    )


def test_a_writable_report_path_passes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    _checked("--report", str(tmp_path / "report.json"))
    assert list(tmp_path.iterdir()) == []


def test_demo_sh_refuses_a_report_directory_before_any_worker_starts(tmp_path: Path) -> None:
    """It trained the whole run, then ended in IsADirectoryError and torchrun's ChildFailedError."""
    done = _demo_sh("--steps", "2", "--report", str(tmp_path))
    assert done.returncode == 2
    assert _lines(done) == [
        f"demo: --report {tmp_path} is a directory; name a file, e.g. --report "
        f"{tmp_path / 'report.json'}"
    ]


def test_demo_sh_refuses_zero_steps_before_any_worker_starts() -> None:
    done = _demo_sh("--steps", "0")
    assert done.returncode == 2
    assert _lines(done) == ["demo: --steps 0: train at least one step (--steps 1 or more)"]


def test_preflight_passes_verbose_through(capsys: Any) -> None:
    assert demo_layout.preflight(["2", "--verbose", "--steps", "3"]) == 0
    assert capsys.readouterr().out.strip() == "--pp 2 --ep 1 --verbose --steps 3"


# ------------------------------------------------------------------------------ MASTER_PORT


def test_an_unset_master_port_is_a_free_one_not_the_old_fixed_default() -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        port = demo_args.master_port({})
        assert port != taken
        with socket.socket() as probe:
            probe.bind(("", port))  # free: raises if not


def test_a_busy_master_port_is_one_line_naming_the_fix() -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DemoArgsError) as err:
            demo_args.master_port({"MASTER_PORT": str(port)})
        assert str(err.value) == (
            f"demo: MASTER_PORT={port} is busy (another demo or job listens there); set another "
            "port, or unset MASTER_PORT to let the demo pick a free one"
        )
        done = _demo_sh("--steps", "2", env={"MASTER_PORT": str(port)})
    assert done.returncode == 2
    assert _lines(done) == [str(err.value)]


def test_a_master_port_that_is_not_a_port_is_refused() -> None:
    with pytest.raises(DemoArgsError) as err:
        demo_args.master_port({"MASTER_PORT": "70000"})
    assert str(err.value) == (
        "demo: MASTER_PORT=70000 is not a port (1-65535); unset it to let the demo pick a free one"
    )


def test_a_free_master_port_that_the_user_set_is_kept() -> None:
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    assert demo_args.master_port({"MASTER_PORT": str(port)}) == port


# ------------------------------------------------------------------------------ trace report


def _fake_titan_trace(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    script = bin_dir / "titan-trace"
    script.write_text(f"#!{sys.executable}\nimport os, sys\nout = sys.argv[4]\n{body}\n")
    script.chmod(0o755)


def test_a_failed_analysis_does_not_name_an_older_runs_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "trace_report" / "report.html"
    old.parent.mkdir()
    old.write_text("an older run's report")
    _fake_titan_trace(
        tmp_path / "bin", "print('titan-trace: DIR traces does not exist', file=sys.stderr)\n"
        "sys.exit(2)"
    )  # fmt: skip
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    text = demo_output.trace_summary(str(tmp_path / "traces"))
    assert text.splitlines() == [
        "",
        "trace analysis of the captured steps (titan-trace analyze):",
        "titan-trace: DIR traces does not exist",
    ]


def test_the_report_this_analysis_wrote_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "trace_report" / "report.html"
    old.parent.mkdir()
    old.write_text("an older run's report")
    _fake_titan_trace(
        tmp_path / "bin",
        "open(os.path.join(out, 'report.html'), 'w').write('this run, a longer report')\n"
        "print('4 ranks analysed')",
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    text = demo_output.trace_summary(str(tmp_path / "traces"))
    assert text.splitlines()[-2:] == ["4 ranks analysed", f"HTML report: {old}"]


# ------------------------------------------------------------------------------------ noise

# Exactly as a 4-rank `./scripts/demo.sh --steps 2` printed them on this CPU machine.
NOISE = [
    "[rank3]:W1207 13:05:45.051000 6852 torch/utils/cpp_extension.py:178] No CUDA runtime is "
    "found, using CUDA_HOME='/usr/local'",
    "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features. "
    "Please reference the migration guide `docs/user-guide/hybrid-model-migration.md` for details "
    "on how to use `HybridModel`",
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "E1207 13:05:46.854215  6852 transfer_metadata.cpp:1098] Local segment descriptor not found",
    "USDT:2026-12-07 13:05:47 6850:6850 SyncActivityProfilerHandler.cpp:52] profiler_start",
    "USDT:2026-12-07 13:05:49 6852:6852 SyncActivityProfilerHandler.cpp:59] profiler_stop",
    "ERROR:2026-12-07 13:05:49 6852:6852 DeviceProperties.cpp:50] gpuGetDeviceCount failed with "
    "code 35",
]
KEPT = [
    "layout: --pp 2 --ep 2 on 4 processes",
    "[rank0]:W1207 13:05:45.051000 6849 torch/distributed/run.py:792] Setting OMP_NUM_THREADS",
    "E1207 13:05:46.854215  6852 transfer_metadata.cpp:1098] Failed to open segment peer:1234",
    "ERROR:2026-12-07 13:05:49 6852:6852 DeviceProperties.cpp:50] gpuGetDeviceCount failed with "
    "code 100",
    "ERROR:2026-12-07 13:05:49 6852:6852 output_json.cpp:612] Failed to write trace",
    "/work/main/x.py:3: UserWarning: a real warning",
    "Traceback (most recent call last):",
    '  File "/work/main/x.py", line 3, in <module>',
    "ValueError: Default process group has not been initialized",
]


def test_the_filter_drops_exactly_the_startup_chatter() -> None:
    import io

    mixed = [line for pair in zip(NOISE, KEPT) for line in pair] + KEPT[len(NOISE) :]
    source = io.BytesIO(("\n".join(mixed) + "\n").encode())
    sink = io.BytesIO()
    assert demo_noise.filter_stream(source, sink) == len(NOISE)
    assert sink.getvalue().decode().splitlines() == KEPT
    assert all(demo_noise.why_noise(line) for line in NOISE)


def test_the_filter_script_passes_stderr_on_and_says_what_it_left_out() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "entrypoints" / "demo_noise.py")],
        input="\n".join(NOISE + KEPT) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == ""
    assert done.stderr.splitlines() == KEPT + [
        f"({len(NOISE)} lines of native libraries' start-up chatter left out; --verbose shows them)"
    ]
