"""The one filter of the native libraries' start-up chatter (``titan_plugins.native_noise``): it
drops exactly the listed lines, each judged whole, and keeps real warnings and tracebacks; the
demo's filter script is a user of it, and ``titan-plugins verify`` runs its children's output
through it at the file-descriptor level (``verify/relay.py``: what glog and Kineto write below
Python), every line with ``--verbose``, and filters a crashed upstream job's log tail too."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from titan_plugins import native_noise

pytestmark = pytest.mark.line_independent

ROOT = Path(__file__).resolve().parents[1]

# Exactly as a 4-rank `./scripts/demo.sh --steps 2` and verify's workers printed them on CPU.
NOISE = [
    "[rank3]:W1207 13:05:45.051000 6852 torch/utils/cpp_extension.py:178] No CUDA runtime is "
    "found, using CUDA_HOME='/usr/local'",
    "W1207 13:05:45.051000 6852 torch/utils/cpp_extension.py:178] No CUDA runtime is found, "
    "using CUDA_HOME='/usr/local/cuda'",
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
    "differential training check (41 s)",
    "[rank0]:W1207 13:05:45.051000 6849 torch/distributed/run.py:792] Setting OMP_NUM_THREADS",
    "E1207 13:05:46.854215  6852 transfer_metadata.cpp:1098] Failed to open segment peer:1234",
    # a listed line with more after it is another line: judged whole, it is kept
    "E1207 13:05:46.854215  6852 transfer_metadata.cpp:1098] Local segment descriptor not found; "
    "retried 3 times and gave up",
    "ERROR:2026-12-07 13:05:49 6852:6852 DeviceProperties.cpp:50] gpuGetDeviceCount failed with "
    "code 100",
    "ERROR:2026-12-07 13:05:49 6852:6852 output_json.cpp:612] Failed to write trace",
    "/work/main/x.py:3: UserWarning: a real warning",
    "Traceback (most recent call last):",
    '  File "/work/main/x.py", line 3, in <module>',
    "ValueError: Default process group has not been initialized",
]


def _mixed() -> list[str]:
    return [line for pair in zip(NOISE, KEPT) for line in pair] + KEPT[len(NOISE) :]


def test_exactly_the_listed_lines_are_chatter_each_with_its_reason() -> None:
    assert [native_noise.why_noise(line) is not None for line in NOISE] == [True] * len(NOISE)
    assert [native_noise.why_noise(line) for line in KEPT] == [None] * len(KEPT)
    assert native_noise.why_noise(NOISE[4]) == native_noise.NOISE[1][1]  # Mooncake's, with why
    assert native_noise.is_noise((NOISE[3] + "\r\n").encode())
    assert not native_noise.is_noise(b"\xff\xfe not utf-8\n")


def test_a_stream_loses_only_the_chatter_and_text_only_its_lines() -> None:
    source = io.BytesIO(("\n".join(_mixed()) + "\n").encode())
    sink = io.BytesIO()
    assert native_noise.filter_stream(source, sink) == len(NOISE)
    assert sink.getvalue().decode().splitlines() == KEPT
    assert native_noise.without_noise("\n".join(_mixed()) + "\n") == "\n".join(KEPT) + "\n"
    assert native_noise.summary(0) == ""
    assert native_noise.summary(3) == (
        "(3 lines of native libraries' start-up chatter left out; --verbose shows them)"
    )


def test_the_demo_filter_is_the_core_s_not_a_copy() -> None:
    from titan_entrypoints import demo_noise

    assert demo_noise.NOISE is native_noise.NOISE
    assert demo_noise.filter_stream is native_noise.filter_stream


_RELAYED = textwrap.dedent(
    """
    import os, subprocess, sys
    from titan_plugins.verify.relay import Relay

    lines = sys.argv[2:]
    with Relay(verbose=sys.argv[1] == "1") as relay:
        # a child writing to the descriptors it inherited, as glog and Kineto do in a worker
        script = "import os, sys\\nfor l in sys.argv[1:]: os.write(2, (l + '\\\\n').encode())"
        subprocess.run([sys.executable, "-c", script, *lines], check=True)
        print("from the parent", flush=True)
    print(f"dropped {relay.dropped}", flush=True)
    """
)


@pytest.mark.parametrize("verbose", [False, True])
def test_verify_s_relay_filters_what_its_children_write_to_the_descriptors(verbose: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RELAYED, "1" if verbose else "0", *_mixed()],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == (_mixed() if verbose else KEPT)
    dropped = 0 if verbose else len(NOISE)
    assert done.stdout.splitlines() == ["from the parent", f"dropped {dropped}"]


def test_a_crashed_upstream_job_s_log_tail_is_printed_without_the_chatter(tmp_path) -> None:
    from titan_plugins.verify import upstream

    (tmp_path / "0.rank0.log").write_text("\n".join(_mixed()) + "\n")
    crashed = SimpleNamespace(returncode=-11)  # a rank ended by a signal
    problem, tail = upstream._problem([crashed], True, [""], tmp_path / "0")
    assert problem == "rank(s) [0] exited abnormally"
    assert tail.splitlines() == KEPT
