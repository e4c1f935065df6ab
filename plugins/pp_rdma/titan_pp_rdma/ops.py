"""Async op handles (torch.distributed ``Work``-like) and the per-peer protocol state."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from titan_pp_rdma.buffers import RecvRing, StagingPool
from titan_pp_rdma.mooncake_engine import PeerAddress
from titan_pp_rdma.wire import tensor_key

if TYPE_CHECKING:
    from titan_pp_rdma.transport import MooncakeTransport


class Op:
    """An async send or receive; ``wait()`` / ``is_completed()`` like a torch.distributed Work."""

    def __init__(self, transport: MooncakeTransport, peer: int, ch: str, key: str, seq: int):
        self.transport, self.peer, self.ch, self.key, self.seq = transport, peer, ch, key, seq
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        """Block (driving progress) until done; raises PPRdmaError / PPRdmaTimeout."""
        self.transport.wait(self)
        return True

    def is_completed(self) -> bool:
        """Drive progress once and tell whether the op is done."""
        self.transport.progress()
        return self.done


class SendOp(Op):
    """A posted send: source bytes (staged copy or pinned alias), then write, then notify."""

    def __init__(
        self, transport: MooncakeTransport, peer: int, ch: str, tensor: torch.Tensor, seq: int
    ):
        super().__init__(transport, peer, ch, tensor_key(tensor.shape, tensor.dtype), seq)
        self.src: torch.Tensor | None = None  # flat bytes the write reads
        self.pooled = False  # src is a staging slot to give back
        self.registered = False  # src was registered for this op only
        self.event: Any = None  # device copy into src still running
        self.batch_id: int | None = None
        self.remote_slot = -1


class RecvOp(Op):
    """A posted receive into ``tensor``."""

    def __init__(
        self, transport: MooncakeTransport, peer: int, ch: str, tensor: torch.Tensor, seq: int
    ):
        super().__init__(transport, peer, ch, tensor_key(tensor.shape, tensor.dtype), seq)
        self.tensor = tensor
        self.registered = False


class Link:
    """Protocol state towards one peer rank (both channels)."""

    def __init__(self, address: PeerAddress) -> None:
        self.address = address
        self.send_seq = {"f": 0, "b": 0}
        self.recv_seq = {"f": 0, "b": 0}
        self.sends: deque[SendOp] = deque()
        # direct mode: receive addresses the peer posted, and our receives awaiting data
        self.ready: dict[str, dict[int, tuple[str, int]]] = {"f": {}, "b": {}}
        self.waiting: dict[str, dict[int, RecvOp]] = {"f": {}, "b": {}}
        # ring mode: the peer's rings and credits, our rings, arrivals, unmatched messages
        self.remote_rings: dict[tuple[str, str], list[int]] = {}
        self.credits: dict[tuple[str, str], deque[int]] = {}
        self.requested: set[tuple[str, str]] = set()
        self.rings: dict[tuple[str, str], RecvRing] = {}
        self.staging: dict[tuple[str, str], StagingPool] = {}
        self.next_arrival = {"f": 0, "b": 0}
        self.arrived: dict[str, dict[int, tuple[str, int]]] = {"f": {}, "b": {}}
        self.unmatched: dict[str, deque[tuple[str, torch.Tensor]]] = {"f": deque(), "b": deque()}
        self.posted: dict[str, deque[RecvOp]] = {"f": deque(), "b": deque()}
