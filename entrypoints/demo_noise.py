"""Native libraries' start-up chatter, kept out of the CPU demo's output line by line.

``scripts/demo.sh`` pipes the workers' stderr through this file (``--verbose`` does not). Each
pattern below is one exact line a library prints on every rank of a healthy CPU run, and says
why its own log setting cannot silence it; every other line (a real warning, a traceback, a
Kineto or Mooncake error of another kind) passes unchanged. Standard library only.
"""

from __future__ import annotations

import re
import signal
import sys
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
        "torch's cpp_extension finds a CUDA toolkit but no GPU, which is what a CPU demo is",
    ),
    (
        re.compile(r"GPTModel IS DEPRECATED\. GPTModel is only accepting critical bug fixes.*"),
        "Megatron's notice on building the GPTModel the demo trains on purpose (the model the "
        "plugins patch); logged once per pipeline stage",
    ),
)


def why_noise(line: str) -> str | None:
    """Why ``line`` (without its newline) is start-up chatter, or None for a line to keep."""
    for pattern, why in NOISE:
        if pattern.fullmatch(line):
            return why
    return None


def filter_stream(source: BinaryIO, sink: BinaryIO) -> int:
    """Copy ``source`` to ``sink`` line by line, as each line arrives, less the chatter; returns
    how many lines were dropped. Bytes that are not UTF-8 pass through unchanged."""
    dropped = 0
    for raw in iter(source.readline, b""):
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if why_noise(text) is not None:
            dropped += 1
            continue
        sink.write(raw)
        sink.flush()  # a worker's line reaches the terminal when the worker wrote it
    return dropped


def main() -> int:
    """Filter stdin onto stderr (the workers' stderr, from ``scripts/demo.sh``)."""
    # Ctrl-C reaches this process too: keep draining until torchrun has said why it stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dropped = filter_stream(sys.stdin.buffer, sys.stderr.buffer)
    if dropped:
        print(
            f"({dropped} lines of native libraries' start-up chatter left out; "
            "--verbose shows them)",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
