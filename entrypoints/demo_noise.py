"""The CPU demo's filter for the native libraries' start-up chatter: ``scripts/demo.sh`` pipes
the workers' stderr through this file (``--verbose`` does not).

The lines it leaves out, each with why no log setting silences it, are the core's
(:mod:`titan_plugins.native_noise`, which ``titan-plugins verify`` filters its workers' output
with too): one list, not two copies. This file only runs it over stdin and says how many lines it
left out.
"""

from __future__ import annotations

import signal
import sys

from titan_plugins.native_noise import NOISE, filter_stream, summary, why_noise

__all__ = ["NOISE", "filter_stream", "main", "why_noise"]


def main() -> int:
    """Filter stdin onto stderr (the workers' stderr, from ``scripts/demo.sh``)."""
    # Ctrl-C reaches this process too: keep draining until torchrun has said why it stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    closing = summary(filter_stream(sys.stdin.buffer, sys.stderr.buffer))
    if closing:
        print(closing, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
