"""The one filter of the native libraries' start-up chatter (``titan_plugins.native_noise``): it
drops exactly the listed lines, each judged whole, and keeps real warnings and tracebacks; the
demo's filter script is a user of it, not a copy."""

from __future__ import annotations

import io

import pytest

from titan_plugins import native_noise

pytestmark = pytest.mark.line_independent

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
