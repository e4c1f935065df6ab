"""Mooncake pipeline transport: one-sided writes with notification, sleeping progress.

Two buffer modes, agreed by the whole pipeline group at handshake:

- **ring** (default for RDMA): the receiver owns registered slot rings per (peer, channel,
  shape, dtype), reused across microbatches; the sender copies into a registered staging slot,
  writes into a slot it holds a credit for, and notifies ``D``; the receiver copies the slot out
  and returns the credit. Registration happens once per shape; device copies are cheap on GPUs.
- **direct** (default for TCP, where registering memory costs microseconds): the receiver
  registers the receive tensor itself and posts its address (``P``); the sender writes straight
  from the (pinned) source tensor and notifies ``D``. No copy on either side.

Every ``wait`` / ``is_completed`` drives the progress of all ops of the process, so ops posted in
any order complete without a helper thread, and polling sleeps between rounds instead of
spinning (Mooncake's own synchronous calls busy-poll a core).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from titan_pp_rdma.buffers import RecvRing, StagingPool, record_event
from titan_pp_rdma.errors import PPRdmaError, PPRdmaMismatch, PPRdmaTimeout
from titan_pp_rdma.mooncake_engine import PeerAddress
from titan_pp_rdma.notifier import SEPARATOR, Notifier
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
        slots: int,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        self.engine, self.rank, self.tag, self.direct = engine, rank, tag, direct
        self.slots, self.timeout_s, self.device = slots, timeout_s, device
        self.links = {peer: Link(addr) for peer, addr in peers.items()}
        self.error: PPRdmaError | None = None
        self._name = f"{tag}/{rank}"
        self._notifier = Notifier(engine)

    def _notify(self, link: Link, *fields: object) -> None:
        self._notifier.post(link.address, self._name, encode(*fields))

    # ---------------------------------------------------------------- posting
    def isend(self, tensor: torch.Tensor, peer: int, ch: str) -> SendOp:
        """Post a send of ``tensor`` to ``peer`` on ``ch``; the caller may free it at once."""
        self._check()
        link = self.links[peer]
        op = SendOp(self, peer, ch, tensor, link.send_seq[ch])
        link.send_seq[ch] += 1
        tensor = tensor.detach()
        if self.direct:
            # Pin the storage itself: deallocate_output_tensor swaps `out.data` right after
            # posting, and a detached alias keeps the old storage alive until the write is done.
            op.src = _flat_bytes(tensor if tensor.is_contiguous() else tensor.contiguous())
            if self.engine.protocol != "tcp":  # RDMA reads only registered memory
                op.registered = bool(self.engine.register(op.src) is not None)
        else:
            pool = link.staging.get((ch, op.key))
            if pool is None:
                pool = link.staging[(ch, op.key)] = StagingPool(self.engine, op.key, self.device)
            op.src, op.pooled = pool.take(), True
            with torch.no_grad():
                op.src.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        op.event = record_event(op.src)
        link.sends.append(op)
        self.progress()
        return op

    def irecv(self, tensor: torch.Tensor, peer: int, ch: str) -> RecvOp:
        """Post a receive into ``tensor`` (contiguous) from ``peer`` on ``ch``."""
        self._check()
        if not tensor.is_contiguous():
            raise ValueError("pp_rdma: receive tensors must be contiguous")
        link = self.links[peer]
        op = RecvOp(self, peer, ch, tensor, link.recv_seq[ch])
        link.recv_seq[ch] += 1
        if self.direct:
            self.engine.register(_flat_bytes(tensor.detach()))
            op.registered = True
            link.waiting[ch][op.seq] = op
            self._notify(link, "P", ch, op.key, op.seq, tensor.data_ptr())
        elif link.unmatched[ch]:
            key, held = link.unmatched[ch].popleft()
            self._fill(op, key, held)
        else:
            link.posted[ch].append(op)
        self.progress()
        return op

    # ---------------------------------------------------------------- waiting
    def wait(self, op: Op) -> None:
        """Drive progress until ``op`` is done, an error arrives, or the timeout passes."""
        deadline = time.monotonic() + self.timeout_s
        nap = 2e-5
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
        link = self.links[op.peer]
        if isinstance(op, RecvOp):
            state = "no data arrived"
        elif op.batch_id is not None:
            state = "the write never completed"
        elif self.direct:
            state = "the peer never posted the matching receive"
        elif (op.ch, op.key) not in link.remote_rings:
            state = "the peer never answered the buffer handshake"
        else:
            state = "the peer never returned a free buffer (credit)"
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
        """Handle every arrived notification and advance every pending send once."""
        self._check()
        if self._notifier.error is not None:
            self.error = PPRdmaError(f"pp_rdma: rank {self.rank}: {self._notifier.error}")
            raise self.error
        for name, batch in self.engine.poll():
            tag, _, sender = name.rpartition("/")
            if tag == self.tag and int(sender) in self.links:
                for msg in batch.split(SEPARATOR):
                    self._on_message(int(sender), decode(msg))
        for peer, link in self.links.items():
            for op in list(link.sends):
                self._advance(peer, link, op)

    def _target(self, peer: int, link: Link, op: SendOp) -> int | None:
        """The remote address ``op`` may write to now, or None while it must wait."""
        if self.direct:
            posted = link.ready[op.ch].pop(op.seq, None)
            if posted is None:
                return None
            key, addr = posted
            if key != op.key:
                stage = "next" if op.ch == FWD else "previous"
                self.fail(
                    PPRdmaMismatch(
                        f"pp_rdma: rank {self.rank} sends a {CHANNEL_NAMES[op.ch]} tensor with "
                        f"{describe_key(op.key)} to the {stage} stage (rank {peer}), but rank "
                        f"{peer} expects {describe_key(key)}. {_SAME}"
                    )
                )
            return addr
        ring_key = (op.ch, op.key)
        if ring_key not in link.remote_rings:
            if ring_key not in link.requested:
                link.requested.add(ring_key)
                self._notify(link, "R", op.ch, op.key)
            return None
        if not link.credits[ring_key]:
            return None
        op.remote_slot = link.credits[ring_key].popleft()
        return link.remote_rings[ring_key][op.remote_slot]

    def _advance(self, peer: int, link: Link, op: SendOp) -> None:
        assert op.src is not None
        if op.batch_id is None:
            if op.event is not None and not op.event.query():
                return  # the copy into the staging slot is still running on the device
            remote = self._target(peer, link, op)
            if remote is None:
                return
            sid = link.address.session_id
            op.batch_id = self.engine.submit_write(sid, op.src.data_ptr(), remote, op.src.numel())
        status = self.engine.status(op.batch_id)
        if status == 0:
            return
        if status < 0:
            self.fail(
                PPRdmaError(
                    f"pp_rdma: rank {self.rank}: the {CHANNEL_NAMES[op.ch]} write to rank {peer} "
                    f"failed (Mooncake status {status}): the peer died or the link broke"
                )
            )
        self._notify(link, "D", op.ch, op.key, op.seq, op.remote_slot)
        if op.pooled:
            link.staging[(op.ch, op.key)].give_back(op.src)
        elif op.registered:
            self.engine.unregister(op.src)
        op.src, op.done = None, True
        link.sends.remove(op)

    def _on_message(self, peer: int, fields: list[str]) -> None:
        link = self.links[peer]
        kind = fields[0]
        if kind == "E":
            self.error = PPRdmaError(f"pp_rdma: rank {peer} failed: {fields[1]}")
            raise self.error
        ch, key = fields[1], fields[2]
        if kind == "P":
            link.ready[ch][int(fields[3])] = (key, int(fields[4]))
        elif kind == "D" and int(fields[4]) < 0:
            op = link.waiting[ch].pop(int(fields[3]))
            self.engine.unregister(_flat_bytes(op.tensor.detach()))
            op.done = True
        elif kind == "D":
            link.arrived[ch][int(fields[3])] = (key, int(fields[4]))
            # Notifications may overtake each other: deliver strictly in sequence order.
            while link.next_arrival[ch] in link.arrived[ch]:
                key, slot = link.arrived[ch].pop(link.next_arrival[ch])
                link.next_arrival[ch] += 1
                self._deliver(link, ch, key, slot)
        elif kind == "R":
            ring = link.rings.get((ch, key))
            if ring is None:
                ring = link.rings[(ch, key)] = RecvRing(self.engine, key, self.slots, self.device)
            self._notify(link, "A", ch, key, ",".join(str(a) for a in ring.addresses()))
        elif kind == "A":
            link.remote_rings[(ch, key)] = [int(a) for a in fields[3].split(",")]
            link.credits[(ch, key)] = deque(range(len(link.remote_rings[(ch, key)])))
        elif kind == "C":
            link.credits[(ch, key)].append(int(fields[3]))

    def _deliver(self, link: Link, ch: str, key: str, slot: int) -> None:
        src = link.rings[(ch, key)].slot(slot)
        if link.posted[ch]:
            self._fill(link.posted[ch].popleft(), key, src)
        else:
            link.unmatched[ch].append((key, src.clone()))
        event = record_event(src)
        if event is not None:
            event.synchronize()  # the slot must be read before the sender may overwrite it
        self._notify(link, "C", ch, key, slot)

    def _fill(self, op: RecvOp, key: str, src: torch.Tensor) -> None:
        if key != op.key:
            stage = "previous" if op.ch == FWD else "next"
            self.fail(
                PPRdmaMismatch(
                    f"pp_rdma: rank {self.rank} expects a {CHANNEL_NAMES[op.ch]} tensor with "
                    f"{describe_key(op.key)} from the {stage} stage (rank {op.peer}), but rank "
                    f"{op.peer} sent {describe_key(key)}. {_SAME}"
                )
            )
        with torch.no_grad():
            op.tensor.detach().copy_(src)
        op.done = True

    def close(self) -> None:
        """Forget all peers; the transport must not be used afterwards."""
        self.links.clear()
        self.error = PPRdmaError("pp_rdma: transport closed")
