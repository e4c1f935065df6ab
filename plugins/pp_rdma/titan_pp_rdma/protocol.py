"""What the transport does with each control record, and how a receive moves forward.

Every record has already passed its frame's MAC, so it comes from the peer of this session; it
is still checked field by field before anything is done with it (a bug or a confused peer must
not make this rank read from or complete an op with the wrong memory). A record that does not
check out is rejected: logged, counted, never acted on.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from titan_pp_rdma import effects, security
from titan_pp_rdma.buffers import record_event
from titan_pp_rdma.errors import PPRdmaError, PPRdmaMismatch
from titan_pp_rdma.ops import Link, RecvOp, SendOp
from titan_pp_rdma.read_clock import ReadClock
from titan_pp_rdma.wire import CHANNEL_NAMES, CHANNELS, FWD, decode, describe_key, key_nbytes

MAX_REGIONS = 1 << 16  # memory regions a peer may declare at once
MIN_POLL_S = 2e-5  # shortest gap between two polls of one read
MAX_POLL_S = 1e-3  # longest gap, once a read is late
MAX_AHEAD = 1 << 12  # announces a peer may send before this rank posted the receives
_SAME = (
    "Both stages must use the same seq_length, micro_batch_size, hidden_size and pipeline_dtype "
    "(or set variable_seq_lengths=True)"
)


def _c_view(payload: memoryview) -> ctypes.Array:
    """A ctypes view of a writable buffer (the frame body is a bytearray)."""
    return (ctypes.c_char * len(payload)).from_buffer(payload)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat uint8 view (contiguous tensors only)."""
    return t.reshape(-1).view(torch.uint8)


class ProtocolMixin:
    """Incoming records and receive progress (mixed into ``MooncakeTransport``)."""

    engine: Any
    rank: int
    direct: bool
    stats: Any
    error: PPRdmaError | None

    def fail(self, error: PPRdmaError) -> None:  # implemented by the transport
        raise NotImplementedError

    # ------------------------------------------------------------------ incoming records
    def _on_record(self, link: Link, peer: int, text: str, payload: memoryview) -> None:
        fields = decode(text)
        kind = fields[0]
        try:
            if kind == "E" and len(fields) == 2:
                self.error = PPRdmaError(f"pp_rdma: rank {peer} failed: {fields[1]}")
                raise self.error
            if kind in ("S", "I"):
                self._on_announce(link, fields, payload)
            elif kind == "F" and len(fields) == 3:
                self._on_read_done(link, fields[1], int(fields[2]))
            elif kind == "M" and len(fields) == 3:
                base, nbytes = int(fields[1]), int(fields[2])
                if base <= 0 or not 0 < nbytes <= 1 << 40 or len(link.regions) >= MAX_REGIONS:
                    raise ValueError("bad or too many regions")
                link.regions[base] = nbytes
            elif kind == "U" and len(fields) == 2:
                if link.regions.pop(int(fields[1]), None) is None:
                    raise ValueError("unregisters a region never declared")
            elif kind == "T" and len(fields) == 2:
                if self.stats is not None:
                    self.stats.add("notify", time.perf_counter() - int(fields[1]) * 1e-9)
            else:
                raise ValueError("unknown record")
        except (ValueError, KeyError) as exc:
            security.reject("unexpected_record", f"from rank {peer}: {text[:120]!r}: {exc}")

    def _on_announce(self, link: Link, fields: list[str], payload: memoryview) -> None:
        kind = fields[0]
        if len(fields) != (5 if kind == "S" else 4) or fields[1] not in CHANNELS:
            raise ValueError("malformed announce")
        ch, key, seq = fields[1], fields[2], int(fields[3])
        nbytes = key_nbytes(key)
        if seq != link.next_announce[ch] or seq >= link.recv_seq[ch] + MAX_AHEAD:
            raise ValueError(f"sequence {seq}, expected {link.next_announce[ch]}")
        if kind == "I":
            if len(payload) != nbytes:
                raise ValueError(f"{len(payload)} B inline for {nbytes} B")
            link.announced[(ch, seq)] = ("I", key, payload)
        else:
            addr = int(fields[4])
            if link.regions.get(addr, -1) < nbytes:
                raise ValueError(f"address {addr:#x} is not inside memory registered for us")
            link.announced[(ch, seq)] = ("S", key, addr)
        link.next_announce[ch] += 1

    def _on_read_done(self, link: Link, ch: str, seq: int) -> None:
        op = link.sends.pop((ch, seq))  # KeyError: no such send is waiting
        if self.stats is not None:
            self.stats.add("release_wait", time.perf_counter() - op.announced_at)
        self._release_send(link, op)
        op.done = True

    def _release_send(self, link: Link, op: SendOp) -> None:
        if op.buf is None:
            return
        if op.pooled:
            link.pools[("send", op.ch, op.key)].give_back(op.buf)
        else:
            base = op.buf.data_ptr()
            self._timed("register", self.engine.unregister, op.buf)
            link.declared.discard(base)
            link.channel.queue(f"U|{base}")
        op.buf = None

    def _timed(self, phase: str, fn: Any, *args: Any) -> Any:
        if self.stats is None:
            return fn(*args)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.add(phase, time.perf_counter() - start)

    # ------------------------------------------------------------------ receives
    def _advance(self, link: Link, op: RecvOp) -> None:
        if op.batch_id is None:
            if op.event is not None and not op.event.query():
                return
            announced = link.announced.pop((op.ch, op.seq), None)
            if announced is None:
                return
            kind, key, where = announced
            if self.stats is not None:
                self.stats.add("announce_wait", time.perf_counter() - op.posted_at)
            if key != op.key:
                self._mismatch(op, key)
            if kind == "I":
                self._timed("stage_copy", self._copy_inline, op, where)
                self._finish(link, op, read_done=False)
                return
            self._start_read(link, op, where)
        now = time.perf_counter()
        if now < op.due:
            # Not worth asking yet: every poll costs the core the transfer needs (on 2 shared
            # cores, Mooncake's own threads). Rounds run for other reasons too (a post, another
            # record, the wait that follows the post): without this check the round that
            # submitted a read polled it at once and replaced its due time (75% of the
            # predicted duration) with one 20 us away, so a 256 KiB read was polled ~4 times.
            return
        status = self._timed("poll", self.engine.status, op.batch_id)
        if status == 0:
            op.polled_at = now
            # Every 4% of the prediction (20 us to 1 ms) until its end; past it, at gaps growing
            # 1.5x (each poll of a late read takes a little of the core its transfer runs on).
            # Waiting for the predicted end instead left up to a quarter of it unpolled: 7 ms
            # of a 33 ms 64 MiB read.
            op.due = now + op.gap
            if now > op.read_at + op.predicted:
                op.gap = min(op.gap * 1.5, MAX_POLL_S)
            return
        if status < 0:
            self.fail(
                PPRdmaError(
                    f"pp_rdma: rank {self.rank}: reading the {CHANNEL_NAMES[op.ch]} tensor of "
                    f"rank {op.peer} failed (Mooncake status {status}): the peer died or the "
                    "link broke"
                )
            )
        # The sender waits for this to reuse its memory: it leaves before our own bookkeeping.
        link.channel.queue(f"F|{op.ch}|{op.seq}")
        link.channel.flush()
        if self.stats is not None:
            self.stats.add("transfer", now - op.read_at)
            if op.polled_at:  # (a read done at its first poll says nothing about the interval)
                self.stats.add("poll_lag", now - op.polled_at)
        self.read_clock.learn(op.nbytes, op.read_at, op.polled_at, now)
        if op.pooled:
            self._timed("stage_copy", self._copy_out, link, op)
        elif op.buf is not None:
            self._timed("register", self.engine.unregister, op.buf)
        op.buf = None
        self._finish(link, op, read_done=True)

    def _start_read(self, link: Link, op: RecvOp, addr: int) -> None:
        op.nbytes = op.tensor.nbytes
        op.inline = False  # (a peer with a smaller inline size) the helper polls it from now on
        if self.direct:
            # TCP reads need no registered destination; an RDMA NIC does.
            if self.reg_local:
                op.buf = self._timed("register", self.engine.register, op.tensor.detach())
            local = op.tensor.data_ptr()
        else:
            op.buf = self._slot(link, "recv", op)
            local = op.buf.data_ptr()
        op.read_at = time.perf_counter()
        # Polling a read before it can have finished only steals the core it needs: the first
        # poll waits for most of its predicted time (learned per size class, ``read_clock``),
        # later ones every 4% of it, growing once it is late (20 us to 1 ms in all).
        op.predicted = self.read_clock.predict(op.nbytes)
        op.due = op.read_at + 0.75 * op.predicted
        op.gap = min(max(MIN_POLL_S, 0.04 * op.predicted), MAX_POLL_S)
        op.batch_id = self.engine.submit_read(link.segment, local, addr, op.nbytes)

    def _copy_inline(self, op: RecvOp, payload: memoryview) -> None:
        if op.tensor.is_cpu:  # contiguous (irecv checks): one memmove
            ctypes.memmove(op.tensor.data_ptr(), ctypes.addressof(_c_view(payload)), len(payload))
            return
        with torch.no_grad():
            flat_bytes(op.tensor.detach()).copy_(torch.frombuffer(payload, dtype=torch.uint8))

    def _copy_out(self, link: Link, op: RecvOp) -> None:
        assert op.buf is not None
        with torch.no_grad():
            op.tensor.detach().copy_(op.buf.view(op.tensor.dtype).view(op.tensor.shape))
        pool = link.pools[("recv", op.ch, op.key)]
        event = record_event(op.tensor)
        if event is not None:  # the slot is busy until the device copy has read it
            link.busy_slots.append((event, pool, op.buf))
        else:
            pool.give_back(op.buf)

    def _finish(self, link: Link, op: RecvOp, *, read_done: bool) -> None:
        del link.recvs[(op.ch, op.seq)]
        op.done = True
        effects.count("read" if read_done else "inline", op.tensor.nbytes)

    def _mismatch(self, op: RecvOp, key: str) -> None:
        stage = "previous" if op.ch == FWD else "next"
        self.fail(
            PPRdmaMismatch(
                f"pp_rdma: rank {self.rank} expects a {CHANNEL_NAMES[op.ch]} tensor with "
                f"{describe_key(op.key)} from the {stage} stage (rank {op.peer}), but "
                f"rank {op.peer} sent {describe_key(key)}. {_SAME}"
            )
        )

    def _slot(self, link: Link, role: str, op: Any) -> torch.Tensor:  # implemented by transport
        raise NotImplementedError

    reg_local: bool = True
    read_clock: ReadClock  # when reads end, learned from completed ones
