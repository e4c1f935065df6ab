"""Registered buffers, reused across microbatches: receive rings and send staging slots."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from titan_pp_rdma.wire import key_nbytes, parse_key


def record_event(t: torch.Tensor) -> Any:
    """An event after the work queued on ``t``'s device (None on CPU, where copies are eager)."""
    if t.device.type == "cpu":
        return None
    event = getattr(torch, t.device.type).Event()
    event.record()
    return event


def view_as(raw: torch.Tensor, key: str) -> torch.Tensor:
    """A byte slot seen as the key's dtype and shape (no copy)."""
    shape, dtype = parse_key(key)
    return raw.view(dtype).view(shape)


class RecvRing:
    """``slots`` registered slots of one (peer, channel, key) that the peer writes into."""

    def __init__(self, engine: Any, key: str, slots: int, device: torch.device) -> None:
        self.key = key
        self.nbytes = key_nbytes(key)
        self.raw = engine.register(
            torch.empty(slots * self.nbytes, dtype=torch.uint8, device=device)
        )
        self.slots = slots

    def addresses(self) -> list[int]:
        """Slot start addresses, advertised to the sender."""
        base = self.raw.data_ptr()
        return [base + i * self.nbytes for i in range(self.slots)]

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i`` viewed as the key's tensor."""
        return view_as(self.raw[i * self.nbytes : (i + 1) * self.nbytes], self.key)


class StagingPool:
    """Registered send slots of one (peer, channel, key).

    A send copies its tensor into a free slot when it is posted, so the caller's storage may be
    freed or reused at once (``deallocate_pipeline_outputs`` pseudo-frees outputs right after
    posting the send). The pool grows when every slot is in flight instead of blocking the post.
    """

    def __init__(self, engine: Any, key: str, device: torch.device) -> None:
        self._engine = engine
        self.key = key
        self.nbytes = key_nbytes(key)
        self._device = device
        self._free: deque[torch.Tensor] = deque()
        self.allocated = 0

    def take(self) -> torch.Tensor:
        """A free registered slot (allocated and registered on first need)."""
        if self._free:
            return self._free.popleft()
        self.allocated += 1
        raw = torch.empty(self.nbytes, dtype=torch.uint8, device=self._device)
        return self._engine.register(raw)

    def give_back(self, raw: torch.Tensor) -> None:
        """Return a slot once its write has completed."""
        self._free.append(raw)
