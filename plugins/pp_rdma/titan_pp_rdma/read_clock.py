"""When a Mooncake read will end: learned per size class, so polls come when the bytes do.

A pipeline moves a few distinct tensor sizes over and over. One per-byte rate shared by every
size mispredicts all but one of them: on loopback TCP a 256 KiB read costs ~2 ns/B (its fixed
latency dominates) and a 4 MiB read ~0.6 ns/B, so with the rate learned from small reads the
first poll of a 4 MiB read came at ~6 ms, 2.5x after its bytes had landed. Each power-of-two
size class therefore keeps its own estimate of the duration; a class not seen yet is predicted
from the fixed latency plus its bytes at the lowest per-byte cost known.
"""

from __future__ import annotations

READ_LATENCY_S = 3e-5  # a read's fixed cost on loopback TCP, the prior's intercept
MIN_S, MAX_S = 1e-6, 60.0  # estimates stay within these


class ReadClock:
    """Expected duration of a read by size class (``nbytes.bit_length()``)."""

    def __init__(self, seconds_per_byte: float = 1 / 2e9) -> None:
        self.seconds_per_byte = seconds_per_byte  # the prior for classes never seen
        self._learned: dict[int, float] = {}

    def predict(self, nbytes: int) -> float:
        """Seconds a read of ``nbytes`` is expected to take."""
        size_class = nbytes.bit_length()
        learned = self._learned.get(size_class)
        if learned is not None:
            return learned
        # A class not seen yet: the fixed latency plus the bytes at the best rate known. Erring
        # early costs a few polls (every 4% of the prediction); erring late costs the whole gap,
        # so the optimistic rate is the one to use: the per-byte cost of the largest reads seen
        # (a class holds reads of at least 2**(class-1) bytes).
        rate = self.seconds_per_byte
        for learned_class, seconds in self._learned.items():
            rate = min(rate, seconds / (1 << max(learned_class - 1, 0)))
        return READ_LATENCY_S + nbytes * rate

    def learn(self, nbytes: int, read_at: float, pending_at: float, done_at: float) -> None:
        """Update the class of a read submitted at ``read_at``, last seen pending at
        ``pending_at`` (``<= read_at`` when no poll saw it pending) and seen done at ``done_at``.

        Only a read that some poll saw pending tells its duration (it ended between that poll and
        the next), and it moves the estimate more readily down than up. One already done at its
        first poll may have ended long before: learning that would push the next first poll
        later and the estimate up with it, so the estimate only shrinks then (never above what
        this read took), until polls see reads pending again.
        """
        size_class = nbytes.bit_length()
        current = self.predict(nbytes)
        if pending_at > read_at:
            sample = (pending_at + done_at) / 2 - read_at
            # A class's first measurement replaces the guess. Later ones pull the estimate down
            # by half the difference and up by a quarter: one read slowed by a busy core must
            # not delay the first poll of the next ones (late costs the gap, early a poll).
            weight = 0.5 if sample < current else 0.25
            seen = size_class in self._learned
            estimate = current + weight * (sample - current) if seen else sample
        else:
            estimate = min(0.7 * current, done_at - read_at)
        self._learned[size_class] = min(max(estimate, MIN_S), MAX_S)
