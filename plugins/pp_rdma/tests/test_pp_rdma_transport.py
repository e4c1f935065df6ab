"""The transport's device-ordering logic, in one process over a fake in-memory engine.

On a GPU the bytes of a send exist only once the queued kernels ran, a landing slot is busy
until the device copy out of it ran, and a receive tensor recycled by the caching allocator may
still be read by queued kernels. CPU tensors have no events, so the multi-process tests never
take these paths: here fake events (``query()`` controlled by the test) drive them, a fake
engine moves bytes with ``ctypes.memmove`` (a one-sided read), and the two transports talk over
real authenticated control channels on a socket pair. The progress threads are off, so every
step happens where the test calls ``progress()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from titan_pp_rdma import driver, effects, security
from titan_pp_rdma import transport as transport_mod
from titan_pp_rdma.channel import Channel
from titan_pp_rdma.errors import PPRdmaError
from titan_pp_rdma.ops import Link
from titan_pp_rdma.transport import MooncakeTransport
from titan_pp_rdma.wire import BWD, FWD

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

INLINE = 64 << 10  # the default TITAN_PP_RDMA_INLINE_BYTES


class FakeEngine:
    """Just enough of MooncakeEngine: registration no-ops, reads as memmove, no notifications."""

    protocol = "tcp"
    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.reads = 0
        self.registered: dict[int, int] = {}
        self.reads_pending = False  # status() reports every read as still landing
        self.polls: list[float] = []  # when status() was asked (perf_counter)

    def register(self, buf: torch.Tensor) -> torch.Tensor:
        self.registered[buf.data_ptr()] = buf.numel()
        return buf

    def unregister(self, buf: torch.Tensor) -> None:
        self.registered.pop(buf.data_ptr(), None)

    def submit_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> list:
        ctypes.memmove(local_addr, remote_addr, nbytes)
        self.reads += 1
        return [next(self._ids)]

    def status(self, ids: list) -> int:
        self.polls.append(time.perf_counter())
        if self.reads_pending:
            return 0
        ids.clear()
        return 1

    def drain_notifies(self) -> list:
        return []


KEY = security.session_key(b"k" * 32, "t")


def pair(
    direct: bool, background: bool = False
) -> tuple[MooncakeTransport, MooncakeTransport, FakeEngine, FakeEngine]:
    """Two transports (ranks 0 and 1) joined by authenticated channels over a socket pair
    (``background``: with their helper threads)."""
    ea, eb = FakeEngine(), FakeEngine()
    sa, sb = socket.socketpair()
    kw = dict(direct=direct, timeout_s=5.0, device=torch.device("cpu"), background=background)
    a = MooncakeTransport(ea, 0, {1: Link("b", Channel(sa, KEY, 0, 1))}, "t", **kw)
    b = MooncakeTransport(eb, 1, {0: Link("a", Channel(sb, KEY, 1, 0))}, "t", **kw)
    return a, b, ea, eb


def big(fill: float = 1.0) -> torch.Tensor:
    """A tensor too large to travel inline (so it takes the Mooncake read path)."""
    return torch.full((INLINE // 4 + 1,), fill)


class FakeEvent:
    def __init__(self) -> None:
        self.ready = False

    def query(self) -> bool:
        return self.ready


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[FakeEvent]:
    """Every record_event of the transport returns a fresh pending FakeEvent, listed here."""
    from titan_pp_rdma import protocol

    made: list[FakeEvent] = []

    def record(t: torch.Tensor) -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    monkeypatch.setattr(transport_mod, "record_event", record)
    monkeypatch.setattr(protocol, "record_event", record)
    return made


def ready(events: list[FakeEvent]) -> None:
    for event in events:
        event.ready = True


@pytest.mark.parametrize("direct", [True, False])
def test_send_is_announced_only_once_its_device_bytes_exist(direct: bool, events: list) -> None:
    a, b, _, eb = pair(direct)
    x = big() * torch.arange(INLINE // 4 + 1.0)
    send = a.isend(x, 1, FWD)
    y = torch.empty_like(x)
    recv = b.irecv(y, 0, FWD)
    a.progress()
    b.progress()
    assert not recv.done and eb.reads == 0, "read before the producing kernels finished"
    ready(events)
    a.progress()  # announces now
    b.progress()  # starts the read (polled only once it may be done: wait)
    recv.wait()  # copies out, frees the sender
    a.progress()
    assert recv.done and send.done and y.equal(x)


def test_ring_landing_slot_stays_busy_until_the_copy_out_ran(events: list) -> None:
    a, b, _, _ = pair(direct=False)
    send = a.isend(big(), 1, BWD)
    ready(events)
    a.progress()
    y = torch.empty_like(big())
    recv = b.irecv(y, 0, BWD)
    recv.wait()
    assert recv.done and y.equal(big())
    link = b.links[0]
    pool = next(p for (role, _, _), p in link.pools.items() if role == "recv")
    assert len(link.busy_slots) == 1 and not pool._free  # the copy event is still pending
    ready(events)
    b.progress()
    assert not link.busy_slots and len(pool._free) == 1  # back in the pool, reused next time
    a.progress()
    assert send.done


def test_direct_read_waits_for_queued_users_of_the_receive_memory(events: list) -> None:
    a, b, _, eb = pair(direct=True)
    a.isend(big(2.0), 1, FWD)
    events[0].ready = True
    a.progress()
    y = torch.empty_like(big())
    recv = b.irecv(y, 0, FWD)  # its event (queued kernels on recycled memory) is pending
    b.progress()
    assert not recv.done and eb.reads == 0
    events[-1].ready = True
    recv.wait()
    assert recv.done and y.equal(big(2.0))


@pytest.mark.parametrize("direct", [True, False])
def test_small_cpu_tensors_travel_inline_and_large_ones_by_read(direct: bool) -> None:
    effects.reset()
    a, b, ea, eb = pair(direct)
    small, large = torch.arange(100.0), big(3.0)
    sends = [a.isend(small, 1, FWD), a.isend(large, 1, FWD)]
    assert sends[0].done and not sends[1].done  # the inline send owns a copy: done at once
    small.zero_()  # the caller may reuse it at once
    got = [torch.empty(100), torch.empty_like(large)]
    recvs = [b.irecv(got[0], 0, FWD), b.irecv(got[1], 0, FWD)]
    for recv in recvs:  # (a read is polled once it may be done, not in a fixed number of rounds)
        recv.wait()
    sends[1].wait()
    b.progress()  # takes the sender's U record (direct: the region is retired)
    assert all(r.done for r in recvs) and sends[1].done
    assert got[0].equal(torch.arange(100.0)) and got[1].equal(large)
    assert (ea.reads, eb.reads) == (0, 1)
    # titan_effects counts each tensor once, at the receiver, by the path it took
    assert effects.effects() == {
        "inline_messages": 1,
        "inline_bytes": 400,
        "read_messages": 1,
        "read_bytes": large.numel() * 4,
    }
    assert not a.links[1].declared if direct else a.links[1].declared  # direct: region retired
    assert not b.links[0].regions if direct else b.links[0].regions


def test_inline_frames_larger_than_one_receive_arrive_whole() -> None:
    """A receive stops reading when the socket had less than it asked for (no syscall that is
    known to fail): frames of several MiB, which arrive over several receives and several
    wake-ups, must still be taken whole and in order."""
    effects.reset()
    a, b, _, _ = pair(direct=True)
    a.inline_bytes = 4 << 20  # TITAN_PP_RDMA_INLINE_BYTES raised: multi-MiB control frames
    sent = [
        torch.arange(n, dtype=torch.float32) * k for k, n in ((1, 700_000), (2, 3), (3, 900_000))
    ]
    got = [torch.empty_like(t) for t in sent]
    recvs = [b.irecv(g, 0, FWD) for g in got]
    for t in sent:  # the socket buffer cannot hold them all: the sender flushes as the peer reads
        a.isend(t, 1, FWD)
    deadline = time.monotonic() + 10
    while not all(r.done for r in recvs) and time.monotonic() < deadline:
        a.progress()
        b.progress()
    assert all(r.done for r in recvs)
    assert all(g.equal(t) for g, t in zip(got, sent, strict=True))
    assert effects.effects() == {
        "inline_messages": 3,
        "inline_bytes": sum(t.numel() * 4 for t in sent),
    }


def test_a_read_is_first_polled_near_its_predicted_end_not_when_submitted() -> None:
    """Polling a read that was just submitted only takes the core its transfer needs: the first
    poll waits for ``op.due`` (most of the read's predicted time)."""
    a, b, _, eb = pair(direct=True)
    b.read_clock.seconds_per_byte = (
        1 / 0.2e9
    )  # a slow link: the ~64 KiB read is predicted at ~0.36 ms
    x = big(5.0)
    a.isend(x, 1, FWD)
    y = torch.empty_like(x)
    recv = b.irecv(y, 0, FWD)  # the announce is already there: the read starts in this post
    assert eb.reads == 1 and recv.batch_id is not None
    assert eb.polls == [], "the read was polled in the round that submitted it"
    due = recv.due
    assert due > recv.read_at
    recv.wait()
    assert recv.done and y.equal(x)
    assert eb.polls and eb.polls[0] >= due
    assert len(eb.polls) == 1  # the fake read is done by then: one poll in all


def test_a_pending_read_is_polled_at_short_gaps_growing_once_it_is_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the first poll (75% of the prediction) saw it pending, the next come every 4% of
    the prediction until its end, then at gaps growing 1.5x up to ``MAX_POLL_S``; the completed
    read teaches its size class how long such reads take. (A fake clock: on a loaded machine a
    busy loop on the real one misses polls.)"""
    from titan_pp_rdma import protocol

    now = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    a, b, _, eb = pair(direct=True)
    b.read_clock.seconds_per_byte = 1 / 0.05e9  # the ~64 KiB read is predicted at ~1.3 ms
    x, y = big(3.0), torch.empty_like(big())
    a.isend(x, 1, FWD)
    eb.reads_pending = True
    recv = b.irecv(y, 0, FWD)
    end = recv.read_at + recv.predicted
    assert recv.due == pytest.approx(recv.read_at + 0.75 * recv.predicted)
    gap = min(max(protocol.MIN_POLL_S, 0.04 * recv.predicted), protocol.MAX_POLL_S)

    def poll_when_due() -> tuple[float, float]:
        now[0] = recv.due
        before = len(eb.polls)
        b.progress()
        assert len(eb.polls) == before + 1 and not recv.done
        return recv.polled_at, recv.due - recv.polled_at  # when it polled, the gap it set

    early = []
    polled, step = poll_when_due()
    while polled <= end:
        early.append(step)
        polled, step = poll_when_due()
    # from 75% to 100% of the prediction: 7 polls (75%, 79%, ... 99%), each 4% apart
    assert len(early) == 7 and all(g == pytest.approx(gap) for g in early)
    late = [step]
    for _ in range(9):  # 53 us x 1.5 ** 8 > 1 ms
        late.append(poll_when_due()[1])
    assert late[0] == pytest.approx(gap) and late[1] == pytest.approx(1.5 * gap)
    assert all(g2 >= g1 for g1, g2 in zip(late, late[1:], strict=False))
    assert max(late) == pytest.approx(protocol.MAX_POLL_S)
    eb.reads_pending = False
    last_pending = recv.polled_at
    now[0] = recv.due
    b.progress()
    assert recv.done and y.equal(x)
    # the class's first measurement: halfway between the last pending poll and the done one
    took = (last_pending + now[0]) / 2 - recv.read_at
    assert b.read_clock.predict(x.numel() * 4) == pytest.approx(took)


@pytest.mark.parametrize("direct", [True, False])
def test_closing_unregisters_every_buffer_it_registered(direct: bool) -> None:
    """The engine is process-wide: a closed session's memory must leave its registry, else the
    next session's buffer at a recycled address fails with "overlapped memory region"."""
    a, b, ea, eb = pair(direct)
    y = torch.empty_like(big())
    recv = b.irecv(y, 0, FWD)
    send = a.isend(big(1.0), 1, FWD)
    recv.wait()
    send.wait()
    assert recv.done and y.equal(big(1.0))
    a.isend(big(2.0), 1, BWD)  # announced, never received: still registered at close
    assert ea.registered and (direct or eb.registered)  # ring: both sides hold pool slots
    a.close()
    b.close()
    assert ea.registered == {} and eb.registered == {}


def test_memory_a_read_still_lands_in_stays_registered_and_alive() -> None:
    a, b, ea, eb = pair(direct=False)
    a.isend(big(1.0), 1, FWD)
    eb.reads_pending = True
    recv = b.irecv(torch.empty_like(big()), 0, FWD)
    b.progress()
    assert not recv.done and len(eb.registered) == 1
    landing = next(iter(eb.registered))
    lingering = len(transport_mod._LINGERING)
    b.close()
    a.close()
    assert list(eb.registered) == [landing] and ea.registered == {}
    assert [t.data_ptr() for t in transport_mod._LINGERING[lingering:]] == [landing]


def test_the_atexit_flush_waits_until_the_peer_takes_the_last_records() -> None:
    """A job's last "read done" must leave before the process does."""
    import threading

    a, b, _, _ = pair(direct=True)
    a.links[1].channel.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    for _ in range(64):  # more than the socket buffers hold while nobody reads
        a.isend(torch.ones(INLINE // 4), 1, FWD)
    assert not a.flush(0.05)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            b.progress()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert a.flush(10.0)
    finally:
        stop.set()
        reader.join()
    got = [torch.empty(INLINE // 4) for _ in range(64)]
    recvs = [b.irecv(t, 0, FWD) for t in got]
    assert all(r.done for r in recvs) and all(t.eq(1).all() for t in got)


# ---------------------------------------------------------------------- CPU per message
def _trace(monkeypatch: pytest.MonkeyPatch, t: MooncakeTransport, log: list[str]) -> None:
    """Record, in order, each progress round and each sleep of ``t``."""
    real_round, real_block = t._round, t._block

    def round_() -> float | None:
        log.append("round")
        return real_round()

    def block(timeout: float, sockets: bool = True, pokes: bool = False) -> None:
        log.append("sleep")
        real_block(timeout, sockets, pokes)

    monkeypatch.setattr(t, "_round", round_)
    monkeypatch.setattr(t, "_block", block)


def _spins(monkeypatch: pytest.MonkeyPatch, t: MooncakeTransport, log: list[str]) -> None:
    """Record each progress round, spin and sleep of ``t``, in order."""
    _trace(monkeypatch, t, log)
    real_spin = t._spin

    def spin(seconds: float) -> bool:
        arrived = real_spin(seconds)
        log.append("spin: arrived" if arrived else "spin: nothing")
        return arrived

    monkeypatch.setattr(t, "_spin", spin)


def _later(fn: Any, delay: float = 0.05) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), fn()))
    thread.start()
    return thread


def test_a_wait_right_after_its_post_sleeps_before_running_another_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The post's round found nothing to do until the peer answers: a second round at the start
    of the wait would find the same, so the wait goes to sleep on the sockets at once (and the
    peer's answer still wakes it). It does not spin first, however long the spin: a send's
    read-done comes only after the peer's whole read."""
    a, b, _, _ = pair(direct=True)
    a.spin_s = 2.0
    x, y = big(4.0), torch.empty_like(big())
    send = a.isend(x, 1, FWD)
    log: list[str] = []
    _spins(monkeypatch, a, log)
    peer = _later(lambda: b.irecv(y, 0, FWD).wait())
    send.wait()
    peer.join()
    assert send.done and y.equal(x)
    assert log[0] == "sleep" and not any(e.startswith("spin") for e in log), log
    assert log.count("round") == log.count("sleep")  # every wake-up runs one round


def test_a_wait_runs_a_round_first_when_the_last_one_left_work_or_was_not_run(
    monkeypatch: pytest.MonkeyPatch, events: list[FakeEvent]
) -> None:
    """No skipped round when the last one left something to do at once (a send whose device
    bytes were pending) or when an op was posted without a round (inside ``batch``)."""
    a, b, _, _ = pair(direct=True)
    send = a.isend(big(1.0), 1, FWD)  # its event is pending: the round asks to come back now
    assert a._last_due == 0.0
    ready(events)
    from titan_pp_rdma import protocol

    for module in (transport_mod, protocol):  # from here on, device memory is ready at once
        monkeypatch.setattr(module, "record_event", lambda t: None)
    log: list[str] = []
    _trace(monkeypatch, a, log)
    peer = _later(lambda: b.irecv(torch.empty_like(big()), 0, FWD).wait())
    send.wait()
    peer.join()
    assert log[0] == "round", log
    with a.batch():
        recv = a.irecv(torch.empty_like(big()), 1, BWD)
        assert not a._settled  # posted without a round: the state has not been looked at
        _later(lambda: b.isend(big(2.0), 0, BWD).wait())  # (b's own wait ends on a's F)
        log.clear()
        recv.wait()
    assert log[0] == "round", log
    assert recv.done


def test_timer_slack_is_touched_only_by_a_wait_that_polls_a_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait that only sleeps on the sockets (a send waiting for read-done) leaves the thread's
    timer slack alone: a socket wakes it whatever the slack. A wait polling a read lowers it for
    its naps and puts it back."""
    calls: list[int | None] = []
    monkeypatch.setattr(transport_mod, "timer_slack", lambda ns: calls.append(ns) or 50_000)
    a, b, _, eb = pair(direct=True)
    b.read_clock.seconds_per_byte = 1 / 0.02e9  # the read is predicted to take ~3 ms: the wait naps
    x, y = big(6.0), torch.empty_like(big())
    send = a.isend(x, 1, FWD)
    recv = b.irecv(y, 0, FWD)  # the read starts here
    recv.wait()
    send.wait()  # the read-done is there already; it still sleeps (on the sockets) first
    assert recv.done and y.equal(x) and eb.polls
    # b's wait (a read in flight) lowered and restored it; a's wait (a send) never touched it
    assert calls == [transport_mod.FINE_SLACK_NS, 50_000], calls


@pytest.mark.parametrize("spin_s", [0.0, 2.0])
def test_a_receive_whose_record_comes_within_the_spin_is_taken_without_a_sleep(
    monkeypatch: pytest.MonkeyPatch, spin_s: float
) -> None:
    """Where a sleep and its wake-up cost more than a short spin, a wait for a receive checks
    its sockets first: the peer's inline send, 50 ms later, lands with no sleep at all. Without
    the spin (``TITAN_PP_RDMA_SPIN_US=0``) the wait sleeps on the sockets at once."""
    a, b, _, _ = pair(direct=True)
    b.spin_s = spin_s  # (2 s: far longer than the peer's delay, however slow the machine)
    x, y = torch.arange(8.0), torch.zeros(8)
    recv = b.irecv(y, 0, FWD)
    log: list[str] = []
    _spins(monkeypatch, b, log)
    peer = _later(lambda: a.isend(x, 1, FWD))
    recv.wait()
    peer.join()
    assert y.equal(x)
    if spin_s:
        assert "sleep" not in log and log.count("spin: arrived") == 1, log
    else:
        assert log[0] == "sleep" and not any(e.startswith("spin") for e in log), log


def test_a_spin_that_expires_gives_way_to_a_sleep_once_per_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record later than the spin is waited for asleep, and the wait spins no more, not even
    after another record woke it (here a gradient it does not wait for): by then its record is
    late, and a sleep costs less than spinning on."""
    a, b, _, _ = pair(direct=True)
    b.spin_s = 1e-3
    x, y, other = torch.arange(8.0), torch.zeros(8), torch.zeros(8)
    b.irecv(other, 0, BWD)
    recv = b.irecv(y, 0, FWD)
    log: list[str] = []
    _spins(monkeypatch, b, log)
    peer = _later(lambda: (a.isend(x + 1, 1, BWD), time.sleep(0.2), a.isend(x, 1, FWD)), 0.1)
    recv.wait()
    peer.join()
    assert y.equal(x)
    assert [e for e in log if e != "round"] == ["spin: nothing", "sleep", "sleep"], log


# ---------------------------------------------------------------------- hostile input
def _inject(channel: Channel, *records: tuple[str, bytes]) -> None:
    """Send records on an authenticated channel (a peer that is buggy, not a forger)."""
    for text, payload in records:
        channel.queue(text, payload)
    assert channel.flush()


def test_records_that_do_not_check_out_are_rejected_and_never_acted_on() -> None:
    a, b, _, eb = pair(direct=True)
    y = torch.zeros_like(big())
    recv = b.irecv(y, 0, FWD)
    before = sum(security.rejected().values())
    bogus = [
        ("F|f|9999", b""),  # the case: a read-done for a send that does not exist
        ("S|f|float32:16385|0|4096", b""),  # an address outside any declared region
        ("M|4096|10", b""),  # (a well-formed declaration: accepted)
        ("S|f|float32:16385|0|4096", b""),  # declared region too small for the tensor
        ("S|f|float32:16385|7|4096", b""),  # not the next sequence number
        ("I|f|float32:4|0", b"\0" * 3),  # inline payload of the wrong size
        ("S|x|float32:4|0|1", b""),
        ("S|f|complex128:4|0|1", b""),
        ("S|f|float32:99999999999999|0|1", b""),
        ("U|12345", b""),
        ("Z|whatever", b""),
        ("S", b""),
    ]
    _inject(a.links[1].channel, *bogus)
    b.progress()
    assert sum(security.rejected().values()) - before == len(bogus) - 1
    assert not recv.done and eb.reads == 0 and y.eq(0).all()
    send = a.isend(big(5.0), 1, FWD)  # the real traffic still flows
    b.wait(recv)
    a.wait(send)
    assert y.equal(big(5.0))


def test_a_frame_that_fails_its_mac_breaks_the_link() -> None:
    a, b, _, _ = pair(direct=True)
    recv = b.irecv(torch.empty_like(big()), 0, FWD)
    forged = Channel(a.links[1].channel.sock, b"not the key" * 3, 0, 1)
    _inject(forged, ("S|f|float32:16385|0|4096", b""))
    before = security.rejected().get("bad_mac", 0)
    with pytest.raises(transport_mod.PPRdmaError, match="bad_mac"):
        b.wait(recv)
    assert security.rejected()["bad_mac"] == before + 1


def test_mooncake_notifications_are_drained_and_counted() -> None:
    a, _, ea, _ = pair(direct=True)
    ea.drain_notifies = lambda: [("t/1", "F|f|9999")] * 5  # type: ignore[method-assign]
    before = security.rejected().get("mooncake_notification", 0)
    a._drained_at = 0.0
    a.progress()
    assert security.rejected()["mooncake_notification"] == before + 5


def test_the_listener_accepts_only_proven_neighbours() -> None:
    """Set-up under attack: garbage, an absurd length, forged and wrong-session hellos, silent
    and surplus connections reach the listener before the real neighbour; only it gets in."""
    import struct
    import threading

    from titan_pp_rdma import channel

    listener = channel.open_listener("127.0.0.1")
    host, port = listener.getsockname()[:2]
    assert host == "127.0.0.1"
    rogues: list[socket.socket] = []

    def attack() -> None:
        for payload in (
            b"\x00garbage" * 40,
            struct.pack("!I", 1 << 31) + b"x" * 32,
            struct.pack("!I", 16) + b"\0\x0c\0\0\0\0H|t|0|1" + b"\0" * 16,  # no valid MAC
        ):
            s = socket.create_connection((host, port))
            s.sendall(payload)
            rogues.append(s)
        other = security.session_key(b"k" * 32, "another session")
        rogues.append(channel.connect(host, port, other, 0, 1, "t", 5.0).sock)
        for _ in range(channel.MAX_PENDING + 4):  # silent, and more than the listener holds
            rogues.append(socket.create_connection((host, port)))

    before = security.rejected().get("unauthenticated_connection", 0)
    result: dict = {}
    acceptor = threading.Thread(
        target=lambda: result.update(got=channel.accept(listener, KEY, 1, "t", {0}, 30.0))
    )
    acceptor.start()
    attack()
    real = channel.connect(host, port, KEY, 0, 1, "t", 30.0)
    real.queue("F|f|0")  # sent right behind the hello: must not be lost
    assert real.flush()
    acceptor.join(60)
    listener.close()
    got = result["got"]
    assert set(got) == {0}
    records = []
    for _ in range(100):
        records += got[0].receive()
        if records:
            break
        time.sleep(0.01)
    assert [text for text, _ in records] == ["F|f|0"]
    assert security.rejected()["unauthenticated_connection"] - before >= 4
    for s in rogues:
        s.close()
    got[0].close()
    real.close()


# ---------------------------------------------------------------------- the helper thread
def _helper_rounds(monkeypatch: pytest.MonkeyPatch, t: MooncakeTransport) -> list[float]:
    """When ``t``'s helper thread ran each of its progress rounds (the caller's are not listed)."""
    real_round, log = t._round, []

    def round_() -> float | None:
        if threading.current_thread() is t._thread:
            log.append(time.perf_counter())
        return real_round()

    monkeypatch.setattr(t, "_round", round_)
    return log


def _until(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-3)
    return True


def test_the_helper_runs_no_rounds_while_only_inline_receives_are_outstanding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receive the peer sends inline completes in its owner's wait with no transfer to
    overlap: the helper leaves it alone (each of its rounds takes the GIL from a computing
    training thread; it ran one every millisecond while any op was outstanding) and the
    receive still completes in the wait."""
    monkeypatch.setattr(driver, "HOUSEKEEPING_S", 30.0)
    a, b, _, _ = pair(direct=True, background=True)
    try:
        rounds = _helper_rounds(monkeypatch, b)
        y = torch.empty(100)
        recv = b.irecv(y, 0, FWD)
        time.sleep(0.2)  # the training thread "computes"; the helper glances every 5 ms
        assert not rounds, f"{len(rounds)} helper rounds in 0.2 s for an inline receive"
        a.isend(torch.arange(100.0), 1, FWD)
        recv.wait()
        assert y.equal(torch.arange(100.0))
    finally:
        a.close()
        b.close()


def test_an_idle_helper_takes_up_a_transfer_posted_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receive too large to travel inline needs its read started and polled while the owner
    computes, and a send its read-done answered: helpers that idled (no rounds) see the posts
    at their next glance and complete both ops with no wait or progress call from either
    owner."""
    monkeypatch.setattr(driver, "HOUSEKEEPING_S", 30.0)
    a, b, _, eb = pair(direct=True, background=True)
    try:
        rounds = _helper_rounds(monkeypatch, b)
        time.sleep(0.05)
        assert not rounds, "a helper with nothing to do ran rounds"
        x, y = big(3.0), torch.empty_like(big())
        recv = b.irecv(y, 0, FWD)
        send = a.isend(x, 1, FWD)
        assert _until(lambda: recv.done and send.done), "the idle helpers did not take them up"
        assert y.equal(x) and eb.reads == 1 and rounds
    finally:
        a.close()
        b.close()
    assert b.helper_rounds == len(rounds)  # (what the benchmark reports) the helper stopped


def test_the_helper_polls_a_read_of_a_receive_it_expected_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer with a smaller inline size sends a small tensor by read: once the owner's round
    started that read, the helper polls it to completion (and answers the read-done) with no
    further call from the owner, as for any read."""
    monkeypatch.setattr(driver, "HOUSEKEEPING_S", 30.0)
    a, b, _, eb = pair(direct=True, background=True)
    a.inline_bytes = 0  # every tensor of rank 0 travels by read
    try:
        y = torch.empty(100)
        recv = b.irecv(y, 0, FWD)  # expected inline: the helper leaves it alone
        send = a.isend(torch.arange(100.0), 1, FWD)
        assert select.select([b.links[0].channel], [], [], 10.0)[0], "no announce arrived"
        eb.reads_pending = True  # until the owner's round has returned
        b.progress()  # the owner's round: the announce arrives and the read starts
        assert eb.reads == 1 and not recv.done
        eb.reads_pending = False  # landed: only a poll can tell now
        assert _until(lambda: recv.done and send.done), "nobody polled the read"
        assert y.equal(torch.arange(100.0))
    finally:
        a.close()
        b.close()


def test_a_quiet_helper_sleeps_until_housekeeping_and_the_post_that_needs_it_wakes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once no op has needed the helper for QUIET_S it stops glancing every IDLE_TICK_S (each
    wake-up costs the training thread's core ~150 us on a small VM) and sleeps until its next
    housekeeping round; the first post that gives it work wakes it, so a transfer posted then
    still completes with no wait or progress call from either owner. (Housekeeping is pushed
    to 30 s: only the glances or the wake-up can explain what the helpers do here.)"""
    monkeypatch.setattr(driver, "HOUSEKEEPING_S", 30.0)
    monkeypatch.setattr(driver, "QUIET_S", 0.05)
    a, b, _, eb = pair(direct=True, background=True)
    try:
        wakes: list[float] = []
        real_block = b._block

        def block(timeout: float, sockets: bool = True, pokes: bool = False) -> None:
            if threading.current_thread() is b._thread:
                wakes.append(time.perf_counter())
            real_block(timeout, sockets, pokes)

        monkeypatch.setattr(b, "_block", block)
        assert _until(lambda: a._quiet and b._quiet), "the helpers never became quiet"
        wakes.clear()
        time.sleep(0.2)  # the training thread "computes" with nothing outstanding
        assert len(wakes) <= 1, f"a quiet helper woke {len(wakes)} times in 0.2 s"
        x, y = big(5.0), torch.empty_like(big())
        recv = b.irecv(y, 0, FWD)  # needs the helper: it is woken, once
        send = a.isend(x, 1, FWD)
        # (not the flags: a test thread stalled for QUIET_S on a loaded machine sees helpers
        # that woke, moved the transfer and went quiet again; with housekeeping at 30 s only a
        # woken helper completes the transfer in time)
        assert _until(lambda: recv.done and send.done, 5.0), "the quiet helpers were not woken"
        assert y.equal(x) and eb.reads == 1
    finally:
        a.close()
        b.close()


def test_a_helper_sleeps_on_the_sockets_while_only_a_record_can_move_its_ops(
    monkeypatch: pytest.MonkeyPatch, events: list[FakeEvent]
) -> None:
    """While its ops wait for records (a receive for its announce, a send for its read-done)
    the helper sleeps on the control sockets instead of ticking every millisecond, and a
    record wakes it: a read starts as soon as its announce arrives. A post that needs polling
    (here a send whose device bytes are not there yet) wakes a listening helper. No owner waits
    or calls progress; housekeeping is pushed to 30 s."""
    monkeypatch.setattr(driver, "HOUSEKEEPING_S", 30.0)
    a, b, _, eb = pair(direct=False, background=True)
    try:
        rounds = _helper_rounds(monkeypatch, b)
        y = torch.empty_like(big())
        recv = b.irecv(y, 0, FWD)  # waits for an announce: only a record can move it
        a.irecv(torch.empty_like(big()), 1, BWD)  # (never sent: keeps a's helper listening)
        assert _until(lambda: a._listening and b._listening), "the helpers never listened"
        rounds.clear()
        time.sleep(0.2)
        assert len(rounds) <= 1, f"a listening helper ran {len(rounds)} rounds in 0.2 s"
        send = a.isend(big(7.0), 1, FWD)  # not announced before its (fake) device event
        assert not a._listening, "the post that needs polling did not wake the helper"
        ready(events)  # the bytes exist: a's helper announces, b's wakes on it and reads
        assert _until(lambda: recv.done and send.done, 5.0), "the helpers stalled"
        assert y.equal(big(7.0)) and eb.reads == 1
    finally:
        a.close()
        b.close()


def test_a_wait_that_took_the_record_a_listening_helper_sleeps_on_wakes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The helper decides to listen, then (before it sleeps) its owner's wait takes the
    records it would have woken on: the announces of two receives. The wait returns with the
    second read still in flight; that read is the helper's now, so the wait wakes it (else it
    would sleep until housekeeping, here 30 s, and the sender's memory with it). Ring buffers:
    direct sends retire their region after the read-done, and that record would wake it."""
    monkeypatch.setattr(driver, "HOUSEKEEPING_S", 30.0)
    a, b, _, eb = pair(direct=False, background=True)
    parked, go = threading.Event(), threading.Event()
    real_block, real_status = b._block, eb.status
    slow: list[int] = []  # the second read's ids: pending until the test lets it land

    def block(timeout: float, sockets: bool = True, pokes: bool = False) -> None:
        if threading.current_thread() is b._thread and sockets and not go.is_set():
            parked.set()  # listening decided, lock released, not asleep yet
            go.wait(10.0)
        real_block(timeout, sockets, pokes)

    def submit_read(peer: str, local: int, remote: int, nbytes: int) -> list:
        ctypes.memmove(local, remote, nbytes)
        eb.reads += 1
        ids = [next(eb._ids)]
        if eb.reads == 2:
            slow.extend(ids)
        return ids

    monkeypatch.setattr(b, "_block", block)
    monkeypatch.setattr(eb, "submit_read", submit_read)
    monkeypatch.setattr(eb, "status", lambda ids: 0 if set(ids) & set(slow) else real_status(ids))
    try:
        y1, y2 = torch.empty_like(big()), torch.empty_like(big())
        first, second = b.irecv(y1, 0, FWD), b.irecv(y2, 0, BWD)
        assert parked.wait(10.0), "the helper never listened"
        sends = [a.isend(big(1.0), 1, FWD), a.isend(big(2.0), 1, BWD)]
        assert select.select([b.links[0].channel], [], [], 10.0)[0]
        time.sleep(0.05)  # (both announces in)
        first.wait()  # takes both announces, starts both reads; the second stays in flight
        assert eb.reads == 2 and not second.done
        slow.clear()  # it lands; only a poll can tell
        go.set()  # the helper goes to sleep on sockets that have nothing more for it
        assert _until(lambda: second.done and all(s.done for s in sends), 5.0), "stalled"
        assert y1.equal(big(1.0)) and y2.equal(big(2.0))
    finally:
        go.set()
        a.close()
        b.close()


class _ParkingLock:
    """The transport's lock, but the helper thread parks right after releasing it once it has
    decided to listen (the moment a post can still clear that decision)."""

    def __init__(self, t: MooncakeTransport) -> None:
        self.t, self.real = t, t._lock
        self.parked, self.go = threading.Event(), threading.Event()

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        return self.real.acquire(*args, **kwargs)

    def release(self) -> None:
        self.real.release()
        if threading.current_thread() is self.t._thread and self.t._listening:
            if not self.go.is_set():
                self.parked.set()
                self.go.wait(10.0)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextlib.contextmanager
def _parked_listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """Rank 0's helper parked just after it decided to listen (a receive it waits on is never
    sent), rank 1 waiting for a read-path tensor from it; housekeeping pushed to 30 s, so only
    the helpers' own wake-ups move anything. Yields ``(a, b, eb, lock, recv, y)``."""
    monkeypatch.setattr(driver, "HOUSEKEEPING_S", 30.0)
    a, b, _, eb = pair(direct=False, background=True)
    lock = _ParkingLock(a)
    monkeypatch.setattr(a, "_lock", lock)
    try:
        y = torch.empty_like(big())
        recv = b.irecv(y, 0, FWD)
        a.irecv(torch.empty_like(big()), 1, BWD)  # (never sent: a's helper listens)
        assert lock.parked.wait(10.0), "a's helper never decided to listen"
        yield a, b, eb, lock, recv, y
    finally:
        lock.go.set()
        a.close()
        b.close()


def test_a_post_that_clears_the_listening_flag_before_the_helper_sleeps_does_not_stop_it(
    monkeypatch: pytest.MonkeyPatch, events: list[FakeEvent]
) -> None:
    """The helper decides to listen and releases the lock; before it sleeps, a post that needs
    polling clears the flag and pokes it. The helper must act on the decision it took (and
    wake at once on the poke), not re-read the flag: re-reading it took it down the polling
    path with nothing to poll, and the helper thread died of a TypeError."""
    with _parked_listener(monkeypatch) as (a, b, eb, lock, recv, y):
        send = a.isend(big(3.0), 1, FWD)  # its device bytes are not there yet: needs polling
        assert not a._listening
        lock.go.set()
        ready(events)
        assert _until(lambda: recv.done and send.done, 5.0), "a's helper stopped"
        assert a._thread is not None and a._thread.is_alive()
        assert y.equal(big(3.0)) and eb.reads == 1


def test_a_helper_that_fails_outside_its_rounds_fails_the_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug anywhere in the helper's loop (here its sleep raising) surfaces as the
    transport's error at the next op, instead of a thread that died quietly and left the
    transfers without overlap."""
    a, b, _, _ = pair(direct=True, background=False)
    try:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("broken sleep")

        monkeypatch.setattr(b, "_block", broken)
        b._thread = threading.Thread(target=b._drive, daemon=True)
        b._thread.start()
        b._thread.join(5.0)
        assert not b._thread.is_alive()
        with pytest.raises(PPRdmaError, match="progress thread failed.*broken sleep"):
            b.irecv(torch.empty(10), 0, FWD)
    finally:
        a.close()
        b.close()


def test_a_wait_does_not_swallow_the_poke_meant_for_the_helper(
    monkeypatch: pytest.MonkeyPatch, events: list[FakeEvent]
) -> None:
    """A post pokes a helper that decided to listen but is not asleep yet, and its owner then
    waits (here for a small tensor the peer sends 0.1 s later). The poke stays the helper's:
    a wait that also watched the wake-up socket drained it, and the helper then slept through
    the post's work until housekeeping (30 s here)."""
    with _parked_listener(monkeypatch) as (a, b, eb, lock, recv, y):
        send = a.isend(big(4.0), 1, FWD)  # needs polling: pokes the helper
        small = torch.empty(10)
        later = threading.Timer(0.1, lambda: b.isend(torch.arange(10.0), 0, FWD))
        later.start()
        a.irecv(small, 1, FWD).wait()  # the owner sleeps while the poke is pending
        later.join()
        lock.go.set()
        ready(events)
        assert _until(lambda: recv.done and send.done, 5.0), "the helper slept through its poke"
        assert y.equal(big(4.0)) and small.equal(torch.arange(10.0)) and eb.reads == 1
