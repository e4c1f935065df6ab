"""Mooncake pipeline transport: announce with a notification, move with a one-sided read.

For every pipeline tensor the sender makes its bytes available in registered memory and
notifies the receiver ``S|ch|key|seq|addr``; the receiver, once its receive is posted, reads the
bytes with one one-sided Mooncake read (RDMA READ on a NIC), then notifies ``F|ch|seq`` so the
sender may reuse the memory. Matching is by (channel, sequence number), so with PP=2 (previous ==
next rank) an activation is never taken for a gradient whatever order the ops were posted in,
and the receiver checks the announced shape and dtype against its own before moving a byte.

Buffers (``TITAN_PP_RDMA_BUFFERS``), chosen by each side independently:
- ``ring``: registered slots per (peer, channel, shape, dtype), reused across microbatches; the
  sender copies into one at post time, the receiver lands the read in one and copies it out.
  Registration happens once per shape (the RDMA default: registering fresh memory costs there).
- ``direct``: the source tensor (pinned by a detached alias, so ``deallocate_output_tensor``
  cannot free it in flight) and the receive tensor are registered per op: no copies (the TCP
  default: registration costs microseconds there).

Every ``wait`` / ``is_completed`` drives the progress of all ops of the process, so ops posted in
any order complete without a helper thread, and polling sleeps between rounds instead of
spinning (Mooncake's own synchronous calls busy-poll a core).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from titan_pp_rdma.buffers import SlotPool, record_event
from titan_pp_rdma.errors import PPRdmaError, PPRdmaMismatch, PPRdmaTimeout
from titan_pp_rdma.mooncake_engine import PeerAddress
from titan_pp_rdma.notifier import SEPARATOR
from titan_pp_rdma.ops import Link, Op, RecvOp, SendOp
from titan_pp_rdma.wire import CHANNEL_NAMES, FWD, decode, describe_key, encode

# Longest sleep between two progress polls: long enough to leave the core to the peer and to
# Mooncake's TCP threads, short next to a transfer (~0.1 ms on loopback).
_MAX_NAP_S = 1e-4
_SAME = (
    "Both stages must use the same seq_length, micro_batch_size, hidden_size and pipeline_dtype "
    "(or set variable_seq_lengths=True)"
)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class MooncakeTransport:
    """Async point-to-point tensor transport between this rank and its pipeline neighbours."""

    def __init__(
        self,
        engine: Any,
        rank: int,
        peers: dict[int, PeerAddress],
        tag: str,
        *,
        direct: bool,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        self.engine, self.rank, self.tag, self.direct = engine, rank, tag, direct
        self.timeout_s, self.device = timeout_s, device
        self.links = {peer: Link(addr) for peer, addr in peers.items()}
        self.error: PPRdmaError | None = None
        self._name = f"{tag}/{rank}"
        self._notifier = engine.notifier

    def _notify(self, link: Link, *fields: object) -> None:
        self._notifier.post(link.address, self._name, encode(*fields))

    def _slot(self, link: Link, role: str, op: Op) -> torch.Tensor:
        pool = link.pools.get((role, op.ch, op.key))
        if pool is None:
            pool = link.pools[(role, op.ch, op.key)] = SlotPool(self.engine, op.key, self.device)
        op.pooled = True
        return pool.take()

    def _release(self, link: Link, role: str, op: Op) -> None:
        if op.buf is None:
            return
        if op.pooled:
            link.pools[(role, op.ch, op.key)].give_back(op.buf)
        else:
            self.engine.unregister(op.buf)
        op.buf = None

    # ---------------------------------------------------------------- posting
    def isend(self, tensor: torch.Tensor, peer: int, ch: str) -> SendOp:
        """Post a send of ``tensor`` to ``peer`` on ``ch``; the caller may free it at once."""
        self._check()
        link = self.links[peer]
        op = SendOp(self, peer, ch, tensor, link.send_seq[ch])
        link.send_seq[ch] += 1
        tensor = tensor.detach()
        if self.direct and tensor.is_contiguous():
            try:  # the detached alias keeps this storage even when the caller swaps `out.data`
                op.buf = self.engine.register(_flat_bytes(tensor))
            except PPRdmaError:
                op.buf = None  # e.g. overlaps a registered region: stage a copy instead
        if op.buf is None:
            op.buf = self._slot(link, "send", op)
            with torch.no_grad():
                op.buf.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        link.sends[(ch, op.seq)] = op
        # On a GPU the bytes exist once the queued kernels ran: announce then, without
        # blocking the host (progress polls the event).
        op.event = record_event(op.buf)
        if op.event is None:
            self._announce(link, op)
        else:
            link.unannounced.append(op)
        return op

    def _announce(self, link: Link, op: SendOp) -> None:
        assert op.buf is not None
        self._notify(link, "S", op.ch, op.key, op.seq, op.buf.data_ptr())

    def irecv(self, tensor: torch.Tensor, peer: int, ch: str) -> RecvOp:
        """Post a receive into ``tensor`` (contiguous) from ``peer`` on ``ch``."""
        self._check()
        if not tensor.is_contiguous():
            raise ValueError("pp_rdma: receive tensors must be contiguous")
        link = self.links[peer]
        op = RecvOp(self, peer, ch, tensor, link.recv_seq[ch])
        link.recv_seq[ch] += 1
        if self.direct:
            op.event = record_event(tensor)
        link.recvs[(ch, op.seq)] = op
        self.progress()  # starts the read at once if the sender already announced the bytes
        return op

    # ---------------------------------------------------------------- waiting
    def wait(self, op: Op) -> None:
        """Drive progress until ``op`` is done, an error arrives, or the timeout passes."""
        deadline = time.monotonic() + self.timeout_s
        nap = 1e-5
        while True:
            self.progress()
            if op.done:
                return
            if time.monotonic() > deadline:
                self.error = PPRdmaTimeout(self._stuck(op))
                raise self.error
            # Sleep between polls: a spinning poller steals the core the peer's stage (or
            # Mooncake's own TCP threads) needs.
            time.sleep(nap)
            nap = min(nap * 2, _MAX_NAP_S)

    def _stuck(self, op: Op) -> str:
        if isinstance(op, SendOp):
            state = "the peer never read the tensor (no matching receive, or it died)"
        elif op.batch_id is not None:
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
            try:  # inline, not queued: the caller is about to unwind
                self.engine.notify(link.address, self._name, encode("E", str(error)))
            except PPRdmaError:
                pass
        raise error

    # ---------------------------------------------------------------- progress
    def progress(self) -> None:
        """Handle every arrived notification and advance every posted receive once."""
        self._check()
        for peer, link in self.links.items():
            failed = self._notifier.errors.get(link.address.session_id)
            if failed is not None:
                self.error = PPRdmaError(f"pp_rdma: rank {self.rank} -> rank {peer}: {failed}")
                raise self.error
        for sender, batch in self.engine.poll(self.tag):
            if int(sender) in self.links:
                for msg in batch.split(SEPARATOR):
                    self._on_message(int(sender), decode(msg))
        for link in self.links.values():
            for send in [op for op in link.unannounced if op.event.query()]:
                link.unannounced.remove(send)
                self._announce(link, send)
            for busy in [b for b in link.busy_slots if b[0].query()]:
                link.busy_slots.remove(busy)
                busy[1].give_back(busy[2])
            for op in list(link.recvs.values()):
                self._advance(link, op)

    def _advance(self, link: Link, op: RecvOp) -> None:
        if op.batch_id is None:
            if op.event is not None and not op.event.query():
                return
            announced = link.announced.pop((op.ch, op.seq), None)
            if announced is None:
                return
            key, addr = announced
            if key != op.key:
                stage = "previous" if op.ch == FWD else "next"
                self.fail(
                    PPRdmaMismatch(
                        f"pp_rdma: rank {self.rank} expects a {CHANNEL_NAMES[op.ch]} tensor with "
                        f"{describe_key(op.key)} from the {stage} stage (rank {op.peer}), but "
                        f"rank {op.peer} sent {describe_key(key)}. {_SAME}"
                    )
                )
            if self.direct:
                op.buf = self.engine.register(_flat_bytes(op.tensor.detach()))
            else:
                op.buf = self._slot(link, "recv", op)
            sid = link.address.session_id
            op.batch_id = self.engine.submit_read(sid, op.buf.data_ptr(), addr, op.buf.numel())
        status = self.engine.status(op.batch_id)
        if status == 0:
            return
        if status < 0:
            self.fail(
                PPRdmaError(
                    f"pp_rdma: rank {self.rank}: reading the {CHANNEL_NAMES[op.ch]} tensor of "
                    f"rank {op.peer} failed (Mooncake status {status}): the peer died or the "
                    "link broke"
                )
            )
        if op.pooled:
            assert op.buf is not None
            with torch.no_grad():
                op.tensor.detach().copy_(op.buf.view(op.tensor.dtype).view(op.tensor.shape))
            event = record_event(op.tensor)
            if event is not None:  # the slot is busy until the device copy has read it
                link.busy_slots.append((event, link.pools[("recv", op.ch, op.key)], op.buf))
                op.buf = None
        self._release(link, "recv", op)
        del link.recvs[(op.ch, op.seq)]
        op.done = True
        self._notify(link, "F", op.ch, op.seq)

    def _on_message(self, peer: int, fields: list[str]) -> None:
        link = self.links[peer]
        kind = fields[0]
        if kind == "E":
            self.error = PPRdmaError(f"pp_rdma: rank {peer} failed: {fields[1]}")
            raise self.error
        if kind == "S":
            link.announced[(fields[1], int(fields[3]))] = (fields[2], int(fields[4]))
        elif kind == "F":
            op = link.sends.pop((fields[1], int(fields[2])))
            self._release(link, "send", op)
            op.done = True

    def close(self) -> None:
        """Forget all peers; the transport must not be used afterwards."""
        self.links.clear()
        self.error = PPRdmaError("pp_rdma: transport closed")
        self.engine.close_tag(self.tag)
