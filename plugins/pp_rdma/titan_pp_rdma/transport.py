"""Mooncake pipeline transport: announce on the control channel, move with a one-sided read.

For every pipeline tensor the sender makes its bytes available in memory registered with
Mooncake and announces them to the receiver (``S|ch|key|seq|addr`` on the authenticated control
connection, see ``channel.py``); the receiver, once its receive is posted, checks shape and dtype
against its own and that the address lies in memory the sender registered for this session,
reads the bytes with one one-sided Mooncake read (RDMA READ on a NIC) and answers ``F`` so the
sender may reuse the memory. CPU tensors up to ``TITAN_PP_RDMA_INLINE_BYTES`` travel inside
the announce itself (one message, no transfer, the send completes at once).

Buffers (``TITAN_PP_RDMA_BUFFERS``), chosen by each side independently:
- ``ring``: registered slots per (peer, channel, shape, dtype), reused across microbatches; the
  sender copies into one at post time, the receiver lands the read in one and copies it out.
  Registration happens once per shape (the RDMA default: registering fresh memory costs there).
- ``direct``: the source tensor (pinned by a detached alias, so ``deallocate_output_tensor``
  cannot free it in flight) is registered per op and the read lands in the receive tensor: no
  copies (the TCP default: registration costs microseconds there).

Progress (``driver.py``): a helper thread answers while the training thread computes; a
``wait`` drives progress itself and sleeps in ``select`` between polls of Mooncake's completion
status (Mooncake's own synchronous calls busy-poll a core).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from titan_pp_rdma import security
from titan_pp_rdma.buffers import SlotPool, record_event
from titan_pp_rdma.driver import (
    FINE_SLACK_NS,
    FIRST_NAP_S,
    IDLE_S,
    MAX_NAP_S,
    DriverMixin,
    timer_slack,
)
from titan_pp_rdma.errors import PPRdmaError, PPRdmaTimeout
from titan_pp_rdma.ops import Link, Op, RecvOp, SendOp
from titan_pp_rdma.protocol import ProtocolMixin
from titan_pp_rdma.read_clock import ReadClock
from titan_pp_rdma.wire import CHANNEL_NAMES, describe_key, encode

_DRAIN_EVERY_S = 0.05
# Registered memory a closed transport could not release (a read was still landing in it).
_LINGERING: list[torch.Tensor] = []


class MooncakeTransport(ProtocolMixin, DriverMixin):
    """Async point-to-point tensor transport between this rank and its pipeline neighbours."""

    def __init__(
        self,
        engine: Any,
        rank: int,
        links: dict[int, Link],
        tag: str,
        *,
        direct: bool,
        timeout_s: float,
        device: torch.device,
        inline_bytes: int = 64 << 10,
        spin_s: float = 0.0,
        background: bool = True,
    ) -> None:
        self.engine, self.rank, self.tag, self.direct = engine, rank, tag, direct
        self.timeout_s, self.device, self.inline_bytes = timeout_s, device, inline_bytes
        self.spin_s = spin_s  # how long a receive's wait checks the sockets before it sleeps
        self.reg_local = getattr(engine, "protocol", "tcp") != "tcp"
        self.links = links
        self.error: PPRdmaError | None = None
        self.stats: Any = None  # a stats.PhaseStats to time every phase (benchmarks)
        self._lock = threading.RLock()
        self._batching = False
        # What the last completed round returned, and whether it still describes the state: an
        # op posted without a round since (``batch``), or a round that did not complete, does not.
        self._last_due: float | None = None
        self._settled = False
        self._drained_at = 0.0
        self.read_clock = ReadClock()
        self._start_driver(background, rank)

    def _slot(self, link: Link, role: str, op: Op) -> torch.Tensor:
        pool = link.pools.get((role, op.ch, op.key))
        if pool is None:
            pool = link.pools[(role, op.ch, op.key)] = SlotPool(self.engine, op.key, self.device)
        op.pooled = True
        return self._timed("register", pool.take)

    # ---------------------------------------------------------------- posting
    def isend(self, tensor: torch.Tensor, peer: int, ch: str) -> SendOp:
        """Post a send of ``tensor`` to ``peer`` on ``ch``; the caller may free it at once."""
        # (few tensor calls: on a host whose cores sleep between messages each one costs tens of
        # microseconds the first time, right on the message's critical path)
        nbytes = tensor.nbytes
        inline = nbytes <= self.inline_bytes and tensor.is_cpu
        payload = b""
        if inline:  # a copy now: the caller may reuse the tensor as soon as this returns
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            payload = ctypes.string_at(tensor.data_ptr(), nbytes)
        else:  # the detached alias keeps this storage even when the caller swaps `out.data`
            tensor = tensor.detach()
        with self._lock:
            self._check()
            link = self.links[peer]
            op = SendOp(self, peer, ch, tensor, link.send_seq[ch])
            link.send_seq[ch] += 1
            self._settled = False
            if inline:
                self._stamp(link)
                link.channel.queue(encode("I", ch, op.key, op.seq), payload)
                op.done = True
            else:
                self._stage(link, op, tensor)
                link.sends[(ch, op.seq)] = op
                # On a GPU the bytes exist once the queued kernels ran: announce then, without
                # blocking the host (progress polls the event).
                op.event = record_event(op.buf)
                if op.event is None:
                    self._announce(link, op)
                else:
                    link.unannounced.append(op)
            if not self._batching:
                link.channel.flush()  # the record leaves before this round's other work
                self._rouse(self._round())  # answers and reads that arrived meanwhile move on
        return op

    def _stage(self, link: Link, op: SendOp, tensor: torch.Tensor) -> None:
        if self.direct and tensor.is_contiguous():
            try:
                op.buf = self._timed("register", self.engine.register, tensor)
            except PPRdmaError:
                op.buf = None  # e.g. overlaps a registered region: stage a copy instead
        if op.buf is None:
            op.buf = self._slot(link, "send", op)
            with torch.no_grad():
                self._timed(
                    "stage_copy", op.buf.view(tensor.dtype).view(tensor.shape).copy_, tensor
                )

    def _announce(self, link: Link, op: SendOp) -> None:
        assert op.buf is not None
        base = op.buf.data_ptr()
        if base not in link.declared:
            link.channel.queue(f"M|{base}|{op.buf.nbytes}")
            link.declared.add(base)
        self._stamp(link)
        link.channel.queue(encode("S", op.ch, op.key, op.seq, base))
        op.announced_at = time.perf_counter()

    def _stamp(self, link: Link) -> None:
        if self.stats is not None:
            link.channel.queue(f"T|{int(time.perf_counter() * 1e9)}")

    def irecv(self, tensor: torch.Tensor, peer: int, ch: str) -> RecvOp:
        """Post a receive into ``tensor`` (contiguous) from ``peer`` on ``ch``."""
        if not tensor.is_contiguous():
            raise ValueError("pp_rdma: receive tensors must be contiguous")
        with self._lock:
            self._check()
            link = self.links[peer]
            op = RecvOp(self, peer, ch, tensor, link.recv_seq[ch])
            op.posted_at = time.perf_counter()
            # (the peer's setting is assumed equal to ours; if it is not, the read starts at the
            # next round of a wait or post, or the helper's, no later than HOUSEKEEPING_S, and
            # the helper polls it from then on)
            op.inline = tensor.nbytes <= self.inline_bytes and tensor.is_cpu
            link.recv_seq[ch] += 1
            self._settled = False
            if self.direct:
                op.event = record_event(tensor)
            link.recvs[(ch, op.seq)] = op
            if not self._batching:
                # (starts the read at once if the sender already announced it)
                self._rouse(self._round())
        return op

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Post several ops as one: their records leave in one frame per peer at the end."""
        with self._lock:
            self._batching = True
            try:
                yield
            finally:
                self._batching = False
                for link in self.links.values():  # the records leave before the round's work
                    link.channel.flush()
                self._rouse(self._round())

    # ---------------------------------------------------------------- waiting
    def wait(self, op: Op) -> None:
        """Drive progress until ``op`` is done, an error arrives, or the timeout passes."""
        if op.done:
            return
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self._waiting += 1  # the helper thread stays out of the way meanwhile
            # A wait usually follows the post whose round just ran: when that round found
            # nothing to do before a record arrives or a read's due time, another one now would
            # find the same (a record arriving meanwhile wakes the first sleep at once).
            last = self._last_due
            skip = self._settled and (last is None or last - time.perf_counter() > FIRST_NAP_S)
        nap = FIRST_NAP_S
        # A receive's record comes when the peer posts its send, often within microseconds in
        # a pipeline; a send's read-done only after a whole transfer: only a receive spins.
        spin = self.spin_s if isinstance(op, RecvOp) else 0.0
        slack = None  # lowered the first time this wait naps on a timer
        try:
            while True:
                if skip:
                    skip, due = False, last
                    with self._lock:
                        self._check()
                    if op.done:  # the helper's round completed it before this wait counted
                        return
                else:
                    with self._lock:
                        self._check()
                        due = self._round()
                    if op.done:
                        return
                left = deadline - time.monotonic()
                if left <= 0:
                    with self._lock:
                        self.error = PPRdmaTimeout(self._stuck(op))
                    raise self.error
                if due is None:  # only a record from the peer can move it: sleep on the sockets
                    if spin:  # (once per wait: after it, the record is late and a sleep cheaper)
                        spin, arrived = 0.0, self._spin(min(spin, left))
                        if arrived:
                            continue
                    # (a socket wakes this sleep whatever the timer slack: leave it alone)
                    self._block(min(IDLE_S, left))
                    continue
                if slack is None:  # polling a read: naps must last what they say
                    slack = timer_slack(FINE_SLACK_NS) or 0
                early = due - time.perf_counter()
                if early > nap:  # a transfer that cannot be done yet: sleep most of it
                    self._block(min(early, left))
                    nap = FIRST_NAP_S
                else:  # about due: poll with short, growing naps
                    self._block(min(nap, left))
                    nap = min(nap * 2, MAX_NAP_S)
        finally:
            if slack:
                timer_slack(slack)
            with self._lock:
                self._waiting -= 1
                if not self._waiting:  # a read this wait started is the helper's from now on
                    self._rouse(self._last_due)

    def _stuck(self, op: Op) -> str:
        if isinstance(op, SendOp):
            state = "the peer never read the tensor (no matching receive, or it died)"
        elif getattr(op, "batch_id", None) is not None:
            state = "the read of the announced tensor never completed"
        else:
            state = "the peer never announced the tensor (no data arrived)"
        verb = "receive from" if isinstance(op, RecvOp) else "send to"
        return (
            f"pp_rdma: rank {self.rank} waited {self.timeout_s:g} s for the "
            f"{CHANNEL_NAMES[op.ch]} {verb} rank {op.peer} ({describe_key(op.key)}): {state}. "
            "The peer died, hangs, or is not running the same schedule; raise "
            "TITAN_PP_RDMA_TIMEOUT_S for legitimately long gaps between stages"
        )

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def fail(self, error: PPRdmaError) -> None:
        """Record a fatal error, tell every peer (best effort) and raise it."""
        self.error = error
        for link in self.links.values():
            link.channel.queue(encode("E", str(error)))
            link.channel.flush()
        raise error

    # ---------------------------------------------------------------- progress
    def progress(self) -> None:
        """Handle every arrived record and advance every posted op once."""
        with self._lock:
            self._check()
            self._round()

    def _round(self) -> float | None:
        """One progress round (lock held).

        :return: when (``perf_counter``) something must be polled next, or None when only a
            record from a peer can bring news.
        """
        self._settled = False  # until this round completes
        due = None
        for peer, link in self.links.items():
            for text, payload in link.channel.receive():
                self._on_record(link, peer, text, payload)
        for link in self.links.values():
            while link.unannounced and link.unannounced[0].event.query():  # in stream order
                self._announce(link, link.unannounced.pop(0))
            for busy in [b for b in link.busy_slots if b[0].query()]:
                link.busy_slots.remove(busy)
                busy[1].give_back(busy[2])
            for op in list(link.recvs.values()):
                self._advance(link, op)
                if op.done:
                    continue
                if op.batch_id is not None:  # a read in flight: poll around its predicted end
                    due = op.due if due is None else min(due, op.due)
                elif op.event is not None:
                    due = 0.0
            link.channel.flush()
            if link.unannounced or link.busy_slots or link.channel.wants_write:
                due = 0.0
        for peer, link in self.links.items():  # after the records that came before the end
            channel = link.channel
            if channel.broken or channel.eof:
                why = channel.broken or "closed the connection (it exited, crashed or reset)"
                error = PPRdmaError(f"pp_rdma: rank {self.rank}: pipeline rank {peer} {why}")
                if channel.broken or link.outstanding():
                    self.fail(error)
                # Nothing waits on it (e.g. the peer ended its job): the session is over, the
                # next op or session lookup sees why.
                self.error = self.error or error
        now = time.monotonic()
        if now - self._drained_at > _DRAIN_EVERY_S:
            self._drained_at = now
            self._drain_mooncake()
        self._last_due, self._settled = due, True
        return due

    def _drain_mooncake(self) -> None:
        # pp_rdma sends no Mooncake notifications: whatever arrives there came from someone else.
        for name, msg in self.engine.drain_notifies():
            security.reject("mooncake_notification", f"name {name[:80]!r} msg {msg[:80]!r}")

    def close(self) -> None:
        """Flush, stop the helper thread and close the connections; the transport is done."""
        self.flush(1.0)
        with self._lock:
            self.error = self.error or PPRdmaError("pp_rdma: transport closed")
        self._stop_driver()
        with self._lock:
            for link in self.links.values():
                link.channel.close()
                self._release_memory(link)
            self.links = {}
        self._close_wakeup()

    def _release_memory(self, link: Link) -> None:
        """Unregister what this link registered: the engine is process-wide and outlives us.

        Memory a read may still land in (a receive whose read was submitted and not seen done)
        stays registered and referenced for the life of the process, so the allocator never
        hands it out again while the NIC may write it.
        """
        landing = [
            op for op in link.recvs.values() if op.batch_id is not None and op.buf is not None
        ]
        keep = {op.buf.data_ptr() for op in landing}
        _LINGERING.extend(op.buf for op in landing if not op.pooled)
        # (``unannounced`` sends are in ``sends`` too)
        for op in [*link.sends.values(), *link.recvs.values()]:
            if op.buf is not None and not op.pooled and op.buf.data_ptr() not in keep:
                self.engine.unregister(op.buf)
            op.buf = None
        for pool in link.pools.values():
            _LINGERING.extend(pool.release(keep))
        link.pools, link.busy_slots = {}, []
