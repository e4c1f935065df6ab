"""When reads are predicted to end (``read_clock``): per size class, learned from past reads."""

from __future__ import annotations

import pytest
from titan_pp_rdma.read_clock import READ_LATENCY_S, ReadClock

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

KIB, MIB = 1 << 10, 1 << 20


def _pending_read(clock: ReadClock, nbytes: int, took: float) -> None:
    """A read of ``took`` seconds that a poll saw pending 10 us before its end."""
    clock.learn(nbytes, 100.0, 100.0 + took - 10e-6, 100.0 + took + 10e-6)


def test_a_class_never_seen_is_predicted_from_the_prior() -> None:
    clock = ReadClock(seconds_per_byte=1 / 2e9)
    assert clock.predict(4 * MIB) == pytest.approx(READ_LATENCY_S + 4 * MIB / 2e9)


def test_each_size_class_learns_its_own_duration() -> None:
    """The issue's case: 256 KiB reads at ~2 ns/B (latency-bound) and 4 MiB reads at ~0.6 ns/B.
    One shared per-byte rate predicted the 4 MiB read at ~8 ms, 3x its real 2.5 ms."""
    clock = ReadClock()
    for _ in range(20):
        _pending_read(clock, 256 * KIB, 560e-6)
        _pending_read(clock, 4 * MIB, 2.5e-3)
    assert clock.predict(256 * KIB) == pytest.approx(560e-6, rel=1e-3)
    assert clock.predict(4 * MIB) == pytest.approx(2.5e-3, rel=1e-3)
    # sizes of one class share it (256 KiB + 1 B .. 512 KiB - 1 B would be the next one)
    assert clock.predict(300 * KIB) == clock.predict(500 * KIB)


def test_an_unseen_class_uses_the_cheapest_per_byte_cost_known() -> None:
    """Erring early costs a few polls, erring late the whole gap: a new class gets the best rate
    seen, never a small class's latency-bound cost scaled up."""
    clock = ReadClock(seconds_per_byte=1 / 0.1e9)  # a pessimistic prior
    for _ in range(20):
        _pending_read(clock, 256 * KIB, 600e-6)  # 256 KiB .. 512 KiB class: >= 2.3 ns/B
        _pending_read(clock, 16 * MIB, 8e-3)  # 16 MiB .. 32 MiB class: >= 0.48 ns/B
    rate = 8e-3 / (16 * MIB)
    assert clock.predict(64 * MIB) == pytest.approx(READ_LATENCY_S + 64 * MIB * rate, rel=1e-3)
    assert clock.predict(64 * MIB) < 64 * MIB * 600e-6 / (256 * KIB) / 3


def test_a_read_done_at_its_first_poll_only_shrinks_its_class() -> None:
    """It may have ended long before that poll: the estimate drops (to at most what the read
    took), so later first polls come earlier until one sees a read pending again."""
    clock = ReadClock()
    _pending_read(clock, MIB, 1e-3)
    assert clock.predict(MIB) == pytest.approx(1e-3, rel=1e-3)
    clock.learn(MIB, 10.0, 10.0, 10.0 + 5e-3)  # first poll 5 ms in, already done
    assert clock.predict(MIB) == pytest.approx(0.7e-3)
    clock.learn(MIB, 20.0, 20.0, 20.0 + 0.5e-3)  # done within 0.5 ms: never above that
    assert clock.predict(MIB) == pytest.approx(0.49e-3)  # 0.7 x 0.7 ms < 0.5 ms
    clock.learn(MIB, 30.0, 30.0, 30.0 + 0.2e-3)
    assert clock.predict(MIB) == pytest.approx(0.2e-3)


def test_a_pending_sample_moves_the_estimate_down_by_half_and_up_by_a_quarter() -> None:
    """One read slowed by a busy core must not push the next reads' first polls far late."""
    clock = ReadClock()
    _pending_read(clock, MIB, 1e-3)
    _pending_read(clock, MIB, 5e-3)  # an outlier
    assert clock.predict(MIB) == pytest.approx(2e-3, rel=1e-3)
    _pending_read(clock, MIB, 1e-3)
    assert clock.predict(MIB) == pytest.approx(1.5e-3, rel=1e-3)


def test_estimates_stay_bounded() -> None:
    clock = ReadClock()
    clock.learn(MIB, 0.0, 0.0, 0.0)  # a zero-length observation
    assert clock.predict(MIB) > 0
    _pending_read(clock, 2 * MIB, 1e6)
    assert clock.predict(2 * MIB) <= 60.0
