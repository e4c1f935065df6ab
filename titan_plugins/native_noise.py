"""Native libraries' start-up chatter, recognised line by line: the one filter the CPU demo
(``entrypoints/demo_noise.py``, under ``scripts/demo.sh``) and ``titan-plugins verify`` (its
workers' output, :mod:`titan_plugins.verify.relay`) keep it out of what they print with.

Each pattern below is one exact line a library prints on every rank of a healthy CPU run, and
says why its own log setting cannot silence it; every other line (a real warning, a traceback, a
Kineto or Mooncake error of another kind) passes unchanged. A line is judged whole
(``fullmatch``), never a stream hidden wholesale. Standard library only.
"""

from __future__ import annotations

import re
from typing import BinaryIO

_RANK = r"(?:\[rank\d+\]:)?"  # torch's distributed log prefix on a Python logging line

# (pattern, why it is dropped and why no log setting does it instead)
NOISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"WARNING: Logging before InitGoogleLogging\(\) is written to STDERR"),
        "glog's notice that Mooncake logs before initialising glog; says where logs go, no fault",
    ),
    (
        re.compile(
            r"E\d{4} [\d:.]+ +\d+ transfer_metadata\.cpp:\d+\] Local segment descriptor not found"
        ),
        "Mooncake's P2P-handshake initialize looks up its own segment before it has published "
        "one; MC_LOG_LEVEL has no level above ERROR, and Mooncake sets glog's minloglevel from "
        "it, so GLOG_minloglevel is ignored",
    ),
    (
        re.compile(r"USDT:.* SyncActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)"),
        "Kineto's USDT markers at every trace capture's start and stop; KINETO_LOG_LEVEL=6 would "
        "drop them but also every real Kineto error",
    ),
    (
        re.compile(r"ERROR:.* DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code 35"),
        "Kineto's GPU probe: CUDA error 35 is cudaErrorInsufficientDriver, no CUDA driver on a "
        "CPU machine; KINETO_LOG_LEVEL=5 would drop every other Kineto ERROR with it",
    ),
    (
        re.compile(
            _RANK + r"W[\d :.]+ \d+ torch/utils/cpp_extension\.py:\d+\] "
            r"No CUDA runtime is found, using CUDA_HOME=.*"
        ),
        "torch's cpp_extension finds a CUDA toolkit but no GPU, which is what a CPU run is",
    ),
    (
        re.compile(r"GPTModel IS DEPRECATED\. GPTModel is only accepting critical bug fixes.*"),
        "Megatron's notice on building the GPTModel the demo and verify train on purpose (the "
        "model the plugins patch); logged once per pipeline stage",
    ),
)


def why_noise(line: str) -> str | None:
    """Why ``line`` (without its newline) is start-up chatter, or None for a line to keep."""
    for pattern, why in NOISE:
        if pattern.fullmatch(line):
            return why
    return None


def is_noise(raw: bytes) -> bool:
    """Whether one raw output line (its newline included or not) is start-up chatter; bytes that
    are not UTF-8 are judged as decoded with replacement (and so kept)."""
    return why_noise(raw.decode("utf-8", "replace").rstrip("\r\n")) is not None


def without_noise(text: str) -> str:
    """``text`` less its chatter lines (e.g. a log's tail before it is printed)."""
    return "".join(
        line for line in text.splitlines(keepends=True) if why_noise(line.rstrip("\r\n")) is None
    )


def filter_stream(source: BinaryIO, sink: BinaryIO) -> int:
    """Copy ``source`` to ``sink`` line by line, as each line arrives, less the chatter; returns
    how many lines were dropped. Bytes that are not UTF-8 pass through unchanged."""
    dropped = 0
    for raw in iter(source.readline, b""):
        if is_noise(raw):
            dropped += 1
            continue
        sink.write(raw)
        sink.flush()  # a worker's line reaches the terminal when the worker wrote it
    return dropped


def summary(dropped: int) -> str:
    """The closing line that says how many lines were left out (empty when none)."""
    if not dropped:
        return ""
    return f"({dropped} lines of native libraries' start-up chatter left out; --verbose shows them)"
