"""The transport's device-ordering logic, in one process over a fake in-memory engine.

On a GPU the bytes of a send exist only once the queued kernels ran, a landing slot is busy
until the device copy out of it ran, and a receive tensor recycled by the caching allocator may
still be read by queued kernels. CPU tensors have no events, so the multi-process tests never
take these paths: here fake events (``query()`` controlled by the test) drive them, and a fake
engine moves bytes with ``ctypes.memmove`` (a one-sided read) and delivers notifications.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import pytest
import torch
from titan_pp_rdma import transport as transport_mod
from titan_pp_rdma.mooncake_engine import PeerAddress
from titan_pp_rdma.transport import MooncakeTransport
from titan_pp_rdma.wire import BWD, FWD


class FakeEngine:
    """Just enough of MooncakeEngine: registration no-ops, reads as memmove, inboxes."""

    protocol = "tcp"
    _ids = itertools.count(1)

    def __init__(self, net: dict[str, FakeEngine], session_id: str) -> None:
        self.net, self.session_id = net, session_id
        net[session_id] = self
        self.inbox: list[tuple[str, str]] = []
        self.notifier = self  # transport calls engine.notifier.post / .errors
        self.errors: dict[str, Any] = {}
        self.reads = 0

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.session_id, 0)

    def register(self, buf: torch.Tensor) -> torch.Tensor:
        return buf

    def unregister(self, buf: torch.Tensor) -> None:
        pass

    def submit_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> int:
        ctypes.memmove(local_addr, remote_addr, nbytes)
        self.reads += 1
        return next(self._ids)

    def status(self, bid: int) -> int:
        return 1

    def post(self, peer: PeerAddress, name: str, msg: str) -> None:
        self.net[peer.session_id].inbox.append((name.rpartition("/")[2], msg))

    notify = post

    def poll(self, tag: str) -> list[tuple[str, str]]:
        out, self.inbox = self.inbox, []
        return out

    def close_tag(self, tag: str) -> None:
        pass


class FakeEvent:
    def __init__(self) -> None:
        self.ready = False

    def query(self) -> bool:
        return self.ready


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[FakeEvent]:
    """Every record_event of the transport returns a fresh pending FakeEvent, listed here."""
    made: list[FakeEvent] = []

    def record(t: torch.Tensor) -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    monkeypatch.setattr(transport_mod, "record_event", record)
    return made


def pair(direct: bool) -> tuple[MooncakeTransport, MooncakeTransport, FakeEngine, FakeEngine]:
    net: dict[str, FakeEngine] = {}
    ea, eb = FakeEngine(net, "a"), FakeEngine(net, "b")
    cpu = torch.device("cpu")
    kw = dict(direct=direct, timeout_s=5.0, device=cpu)
    a = MooncakeTransport(ea, 0, {1: eb.address}, "t", **kw)
    b = MooncakeTransport(eb, 1, {0: ea.address}, "t", **kw)
    return a, b, ea, eb


@pytest.mark.parametrize("direct", [True, False])
def test_send_is_announced_only_once_its_device_bytes_exist(direct: bool, events: list) -> None:
    a, b, _, eb = pair(direct)
    x = torch.arange(8.0)
    send = a.isend(x, 1, FWD)
    y = torch.empty(8)
    recv = b.irecv(y, 0, FWD)
    a.progress()
    b.progress()
    assert not recv.done and eb.reads == 0, "read before the producing kernels finished"
    for event in events:
        event.ready = True
    a.progress()  # announces now
    b.progress()  # reads, copies out, frees the sender
    a.progress()
    assert recv.done and send.done and y.equal(x)


def test_ring_landing_slot_stays_busy_until_the_copy_out_ran(events: list) -> None:
    a, b, _, _ = pair(direct=False)
    for event in events:
        event.ready = True
    send = a.isend(torch.ones(4), 1, BWD)
    for event in events:
        event.ready = True
    a.progress()
    y = torch.empty(4)
    recv = b.irecv(y, 0, BWD)
    b.progress()
    assert recv.done and y.equal(torch.ones(4))
    link = b.links[0]
    pool = link.pools[("recv", BWD, "float32:4")]
    assert len(link.busy_slots) == 1 and not pool._free  # the copy event is still pending
    for event in events:
        event.ready = True
    b.progress()
    assert not link.busy_slots and len(pool._free) == 1  # back in the pool, reused next time
    a.progress()
    assert send.done


def test_direct_read_waits_for_queued_users_of_the_receive_memory(events: list) -> None:
    a, b, _, eb = pair(direct=True)
    a.isend(torch.full((3,), 2.0), 1, FWD)
    events[0].ready = True
    a.progress()
    y = torch.empty(3)
    recv = b.irecv(y, 0, FWD)  # its event (queued kernels on recycled memory) is pending
    b.progress()
    assert not recv.done and eb.reads == 0
    events[-1].ready = True
    b.progress()
    assert recv.done and y.equal(torch.full((3,), 2.0))


def test_notifier_flush_waits_for_queued_notifications() -> None:
    """The atexit flush: a job's last "read done" must leave before the process does."""
    import threading
    import time

    from titan_pp_rdma.notifier import Notifier

    gate = threading.Event()
    sent: list[str] = []

    class SlowEngine:
        def notify(self, peer: PeerAddress, name: str, msg: str) -> None:
            gate.wait(5)
            sent.append(msg)

    notifier = Notifier(SlowEngine())
    notifier.post(PeerAddress("p", 0), "t/0", "F|f|0")
    assert not notifier.flush(0.05) and sent == []  # still in flight: flush reports it
    gate.set()
    start = time.monotonic()
    assert notifier.flush(5.0) and sent == ["F|f|0"]
    assert time.monotonic() - start < 2
