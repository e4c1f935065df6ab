"""Mooncake pipeline transport: one-sided writes with notification, credits, sleeping progress.

A send copies its tensor into a registered staging slot, waits (in the progress engine, never in
the caller) for the receiver's slot ring and a free slot (credit), starts a non-blocking write,
and when the write has landed notifies the receiver ``D|ch|key|seq|slot``. The receiver copies the
slot out (into the posted receive tensor, or a held copy when the receive is not posted yet) and
returns the credit. Every ``wait`` / ``is_completed`` drives the progress of all ops of the
process, so ops posted in any order complete without a helper thread, and the polling sleeps
between rounds instead of spinning (Mooncake's own synchronous calls busy-poll a core).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from titan_pp_rdma.buffers import RecvRing, StagingPool, record_event
from titan_pp_rdma.errors import PPRdmaError, PPRdmaMismatch, PPRdmaTimeout
from titan_pp_rdma.mooncake_engine import PeerAddress
from titan_pp_rdma.wire import CHANNEL_NAMES, FWD, decode, describe_key, encode, tensor_key


class _Op:
    """An async send or receive; ``wait()`` / ``is_completed()`` like a torch.distributed Work."""

    def __init__(self, transport: MooncakeTransport, peer: int, ch: str, key: str) -> None:
        self.transport, self.peer, self.ch, self.key = transport, peer, ch, key
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        """Block (driving progress) until done; raises PPRdmaError / PPRdmaTimeout."""
        self.transport.wait(self)
        return True

    def is_completed(self) -> bool:
        """Drive progress once and tell whether the op is done."""
        self.transport.progress()
        return self.done


class SendOp(_Op):
    """A posted send: staged copy, then write, then notification."""

    def __init__(self, transport: MooncakeTransport, peer: int, ch: str, key: str, seq: int):
        super().__init__(transport, peer, ch, key)
        self.seq = seq
        self.staging: torch.Tensor | None = None
        self.event: Any = None
        self.batch_id: int | None = None
        self.remote_slot = -1


class RecvOp(_Op):
    """A posted receive into ``tensor``."""

    def __init__(self, transport: MooncakeTransport, peer: int, ch: str, tensor: torch.Tensor):
        super().__init__(transport, peer, ch, tensor_key(tensor.shape, tensor.dtype))
        self.tensor = tensor


class _Link:
    """Protocol state towards one peer rank."""

    def __init__(self, address: PeerAddress) -> None:
        self.address = address
        self.send_seq = {"f": 0, "b": 0}
        self.next_arrival = {"f": 0, "b": 0}
        self.arrived: dict[str, dict[int, tuple[str, int]]] = {"f": {}, "b": {}}
        self.unmatched: dict[str, deque[tuple[str, torch.Tensor]]] = {"f": deque(), "b": deque()}
        self.posted: dict[str, deque[RecvOp]] = {"f": deque(), "b": deque()}
        self.remote_rings: dict[tuple[str, str], list[int]] = {}
        self.credits: dict[tuple[str, str], deque[int]] = {}
        self.requested: set[tuple[str, str]] = set()
        self.rings: dict[tuple[str, str], RecvRing] = {}
        self.staging: dict[tuple[str, str], StagingPool] = {}
        self.sends: deque[SendOp] = deque()


class MooncakeTransport:
    """Async point-to-point tensor transport between this rank and its pipeline neighbours."""

    def __init__(
        self,
        engine: Any,
        rank: int,
        peers: dict[int, PeerAddress],
        tag: str,
        slots: int,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        self.engine, self.rank, self.tag = engine, rank, tag
        self.slots, self.timeout_s, self.device = slots, timeout_s, device
        self.links = {peer: _Link(addr) for peer, addr in peers.items()}
        self.error: PPRdmaError | None = None
        self._name = f"{tag}/{rank}"

    # ---------------------------------------------------------------- posting
    def isend(self, tensor: torch.Tensor, peer: int, ch: str) -> SendOp:
        """Post a send of ``tensor`` to ``peer`` on channel ``ch``; the tensor may be freed after."""
        self._check()
        link = self.links[peer]
        key = tensor_key(tensor.shape, tensor.dtype)
        op = SendOp(self, peer, ch, key, link.send_seq[ch])
        link.send_seq[ch] += 1
        pool = link.staging.get((ch, key))
        if pool is None:
            pool = link.staging[(ch, key)] = StagingPool(self.engine, key, self.device)
        op.staging = pool.take()
        with torch.no_grad():
            op.staging.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        op.event = record_event(op.staging)
        link.sends.append(op)
        self.progress()
        return op

    def irecv(self, tensor: torch.Tensor, peer: int, ch: str) -> RecvOp:
        """Post a receive into ``tensor`` from ``peer`` on channel ``ch``."""
        self._check()
        link = self.links[peer]
        op = RecvOp(self, peer, ch, tensor)
        if link.unmatched[ch]:
            key, held = link.unmatched[ch].popleft()
            self._fill(op, key, held)
        else:
            link.posted[ch].append(op)
        self.progress()
        return op

    # ---------------------------------------------------------------- waiting
    def wait(self, op: _Op) -> None:
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
            # Mooncake's own TCP threads) needs; the back-off caps the added latency at 0.5 ms.
            time.sleep(nap)
            nap = min(nap * 2, 5e-4)

    def _stuck(self, op: _Op) -> str:
        what = CHANNEL_NAMES[op.ch]
        link = self.links[op.peer]
        if isinstance(op, RecvOp):
            state = "no data arrived"
        elif (op.ch, op.key) not in link.remote_rings:
            state = "the peer never answered the buffer handshake"
        elif op.batch_id is None:
            state = "the peer never returned a free buffer (credit)"
        else:
            state = "the write never completed"
        return (
            f"pp_rdma: rank {self.rank} waited {self.timeout_s:g} s for the {what} "
            f"{'receive from' if isinstance(op, RecvOp) else 'send to'} rank {op.peer} "
            f"({describe_key(op.key)}): {state}. The peer died, hangs, or is not running the "
            "same schedule; raise TITAN_PP_RDMA_TIMEOUT_S for legitimately long stage gaps"
        )

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def fail(self, error: PPRdmaError) -> None:
        """Record a fatal error, tell every peer (best effort) and raise it."""
        self.error = error
        for link in self.links.values():
            try:
                self.engine.notify(link.address, self._name, encode("E", str(error)))
            except PPRdmaError:
                pass
        raise error

    # ---------------------------------------------------------------- progress
    def progress(self) -> None:
        """Handle every arrived notification and advance every pending send once."""
        self._check()
        for name, msg in self.engine.poll():
            tag, _, sender = name.rpartition("/")
            if tag == self.tag and int(sender) in self.links:
                self._on_message(int(sender), decode(msg))
        for peer, link in self.links.items():
            for op in list(link.sends):
                self._advance(peer, link, op)

    def _advance(self, peer: int, link: _Link, op: SendOp) -> None:
        ring_key = (op.ch, op.key)
        if op.batch_id is None:
            if op.event is not None and not op.event.query():
                return  # the staging copy is still running on the device
            if ring_key not in link.remote_rings:
                if ring_key not in link.requested:
                    link.requested.add(ring_key)
                    self.engine.notify(link.address, self._name, encode("R", op.ch, op.key))
                return
            credits = link.credits[ring_key]
            if not credits:
                return
            op.remote_slot = credits.popleft()
            assert op.staging is not None
            op.batch_id = self.engine.submit_write(
                link.address.session_id,
                op.staging.data_ptr(),
                link.remote_rings[ring_key][op.remote_slot],
                op.staging.numel(),
            )
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
        self.engine.notify(
            link.address, self._name, encode("D", op.ch, op.key, op.seq, op.remote_slot)
        )
        link.staging[ring_key].give_back(op.staging)
        op.staging, op.done = None, True
        link.sends.remove(op)

    def _on_message(self, peer: int, fields: list[str]) -> None:
        link = self.links[peer]
        kind = fields[0]
        if kind == "E":
            self.error = PPRdmaError(f"pp_rdma: rank {peer} failed: {fields[1]}")
            raise self.error
        ch, key = fields[1], fields[2]
        if kind == "R":
            ring = link.rings.get((ch, key))
            if ring is None:
                ring = link.rings[(ch, key)] = RecvRing(self.engine, key, self.slots, self.device)
            addrs = ",".join(str(a) for a in ring.addresses())
            self.engine.notify(link.address, self._name, encode("A", ch, key, addrs))
        elif kind == "A":
            link.remote_rings[(ch, key)] = [int(a) for a in fields[3].split(",")]
            link.credits[(ch, key)] = deque(range(len(link.remote_rings[(ch, key)])))
        elif kind == "C":
            link.credits[(ch, key)].append(int(fields[3]))
        elif kind == "D":
            link.arrived[ch][int(fields[3])] = (key, int(fields[4]))
            # Notifications may overtake each other: deliver strictly in sequence order.
            while link.next_arrival[ch] in link.arrived[ch]:
                key, slot = link.arrived[ch].pop(link.next_arrival[ch])
                link.next_arrival[ch] += 1
                self._deliver(peer, link, ch, key, slot)

    def _deliver(self, peer: int, link: _Link, ch: str, key: str, slot: int) -> None:
        src = link.rings[(ch, key)].slot(slot)
        if link.posted[ch]:
            self._fill(link.posted[ch].popleft(), key, src)
        else:
            link.unmatched[ch].append((key, src.clone()))
        event = record_event(src)
        if event is not None:
            event.synchronize()  # the slot must be read before the sender may overwrite it
        self.engine.notify(link.address, self._name, encode("C", ch, key, slot))

    def _fill(self, op: RecvOp, key: str, src: torch.Tensor) -> None:
        if key != op.key:
            direction = "from the previous" if op.ch == FWD else "from the next"
            self.fail(
                PPRdmaMismatch(
                    f"pp_rdma: rank {self.rank} expected a {CHANNEL_NAMES[op.ch]} tensor "
                    f"{direction} stage (rank {op.peer}) with {describe_key(op.key)}, but rank "
                    f"{op.peer} sent {describe_key(key)}. Both stages must use the same "
                    "seq_length, micro_batch_size, hidden_size and pipeline_dtype (or set "
                    "variable_seq_lengths=True)"
                )
            )
        with torch.no_grad():
            op.tensor.detach().copy_(src)
        op.done = True

    def close(self) -> None:
        """Forget all peers; the transport must not be used afterwards (buffers die with it)."""
        self.links.clear()
        self.error = PPRdmaError("pp_rdma: transport closed")
