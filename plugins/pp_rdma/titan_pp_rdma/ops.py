"""Async op handles (torch.distributed ``Work``-like) and the per-peer protocol state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from titan_pp_rdma.buffers import SlotPool
from titan_pp_rdma.wire import tensor_key

if TYPE_CHECKING:
    from titan_pp_rdma.channel import Channel
    from titan_pp_rdma.transport import MooncakeTransport


class Op:
    """An async send or receive; ``wait()`` / ``is_completed()`` like a torch.distributed Work."""

    def __init__(self, transport: MooncakeTransport, peer: int, ch: str, t: torch.Tensor, seq: int):
        self.transport, self.peer, self.ch, self.seq = transport, peer, ch, seq
        self.key = tensor_key(t.shape, t.dtype)
        self.done = False
        self.buf: torch.Tensor | None = None  # registered flat bytes: source or landing place
        self.pooled = False  # ``buf`` is a pool slot (give it back) rather than registered ad hoc

    def wait(self, timeout: Any = None) -> bool:
        """Block (driving progress) until done; raises PPRdmaError / PPRdmaTimeout."""
        self.transport.wait(self)
        return True

    def is_completed(self) -> bool:
        """Drive progress once and tell whether the op is done."""
        if not self.done:
            self.transport.progress()
        return self.done


class SendOp(Op):
    """A posted send: its bytes stay registered and unchanged until the receiver pulled them."""

    def __init__(self, transport: MooncakeTransport, peer: int, ch: str, t: torch.Tensor, seq: int):
        super().__init__(transport, peer, ch, t, seq)
        self.event: Any = None  # device work producing the bytes; announce once it is done
        self.announced_at = 0.0


class RecvOp(Op):
    """A posted receive into ``tensor``: pull once the sender announced the bytes, then copy."""

    def __init__(self, transport: MooncakeTransport, peer: int, ch: str, t: torch.Tensor, seq: int):
        super().__init__(transport, peer, ch, t, seq)
        self.tensor = t
        self.batch_id: int | None = None
        self.nbytes = 0
        self.posted_at = 0.0
        self.read_at = 0.0  # when the read was submitted
        self.due = 0.0  # when polling it is next worth it
        self.predicted = 0.0  # expected duration of the read
        self.gap = 0.0  # between polls once the read is late
        self.polled_at = 0.0  # last poll that found it still pending
        self.inline = False  # small enough that the peer sends it inside its announce
        # direct mode on a GPU: kernels queued before the post may still use this memory (the
        # caching allocator recycles it stream-ordered); a NIC write is not stream-ordered.
        self.event: Any = None


class Link:
    """Protocol state towards one peer rank (both channels)."""

    def __init__(self, segment: str, channel: Channel) -> None:
        self.segment = segment  # the peer's Mooncake segment (what reads target)
        self.channel = channel
        self.send_seq = {"f": 0, "b": 0}
        self.recv_seq = {"f": 0, "b": 0}
        self.next_announce = {"f": 0, "b": 0}  # the only sequence number the peer may announce
        self.sends: dict[tuple[str, int], SendOp] = {}  # announced, awaiting the receiver's F
        self.recvs: dict[tuple[str, int], RecvOp] = {}  # posted, not complete
        # (ch, seq) -> ("S", key, addr) or ("I", key, payload): announced, not yet received
        self.announced: dict[tuple[str, int], tuple[str, str, Any]] = {}
        self.regions: dict[int, int] = {}  # base -> length: memory the peer registered for us
        self.declared: set[int] = set()  # bases of our memory declared to the peer
        self.unannounced: list[SendOp] = []  # sends whose device bytes are not ready yet
        self.busy_slots: list[tuple[Any, SlotPool, torch.Tensor]] = []  # (event, pool, slot)
        self.pools: dict[tuple[str, str, str], SlotPool] = {}  # (role, ch, key)

    def outstanding(self) -> bool:
        """Whether any op of this link still needs the peer."""
        return bool(self.sends or self.recvs or self.unannounced)

    def needs_ticks(self) -> bool:
        """Whether anything outstanding moves only if somebody acts before the owner waits:
        a read to start or poll, a read-done to answer, device work to watch. A receive the
        peer sends inline completes in the owner's own wait with no transfer to overlap."""
        return bool(
            self.sends
            or self.unannounced
            or self.busy_slots
            or self.channel.wants_write
            or any(not op.inline for op in self.recvs.values())
        )
