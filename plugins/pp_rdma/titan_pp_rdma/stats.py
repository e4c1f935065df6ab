"""Per-phase timers of the transport (off unless a benchmark turns them on).

``transport.stats = PhaseStats()`` makes every op record where its time went; ``summary()``
gives count, median and total per phase. Frames carry their send time (``perf_counter``, i.e.
``CLOCK_MONOTONIC``, one clock for every process on a host), so the receiver measures how long a
control message took to arrive.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

PHASES = {
    "notify": "control frame, sent -> handled by the receiver (one way)",
    "announce_wait": "receive posted -> its announce handled (includes the sender being late)",
    "register": "Mooncake register/unregister calls",
    "stage_copy": "copies into / out of registered slots, inline payloads",
    "transfer": "Mooncake read, submitted -> seen complete",
    "poll": "one check of a read's status (the count: polls per read x reads)",
    "poll_lag": "read seen pending for the last time -> seen complete (reads seen pending)",
    "release_wait": "send announced -> the receiver's read-done handled",
}


class PhaseStats:
    """Durations (seconds) per phase name."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def add(self, phase: str, seconds: float) -> None:
        """Record one duration."""
        self.samples[phase].append(seconds)

    def summary(self) -> dict[str, tuple[int, float, float]]:
        """``{phase: (count, median s, total s)}``."""
        return {
            name: (len(v), statistics.median(v), sum(v)) for name, v in self.samples.items() if v
        }

    def clear(self) -> None:
        """Forget every sample."""
        self.samples.clear()
