"""Registered buffers, reused across microbatches: receive rings and send staging slots."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from titan_pp_rdma.wire import key_nbytes, parse_key


def record_event(t: torch.Tensor) -> Any:
    """An event after the work queued on ``t``'s device (None on CPU, where copies are eager)."""
    if t.is_cpu:
        return None
    event = getattr(torch, t.device.type).Event()
    event.record()
    return event


def view_as(raw: torch.Tensor, key: str) -> torch.Tensor:
    """A byte slot seen as the key's dtype and shape (no copy)."""
    shape, dtype = parse_key(key)
    return raw.view(dtype).view(shape)


class SlotPool:
    """Registered slots of one (peer, channel, shape, dtype), reused across microbatches.

    Senders stage into them (the copy at post time also means the caller's storage may be freed
    at once: ``deallocate_pipeline_outputs`` pseudo-frees outputs right after posting the send);
    receivers land pulled bytes in them. The pool grows when every slot is in use instead of
    blocking, so it holds as many slots as the schedule keeps in flight.
    """

    def __init__(self, engine: Any, key: str, device: torch.device) -> None:
        self._engine = engine
        self.key = key
        self.nbytes = key_nbytes(key)
        self._device = device
        self._free: deque[torch.Tensor] = deque()
        self._slots: list[torch.Tensor] = []  # every slot registered, free or in use
        self.allocated = 0

    def take(self) -> torch.Tensor:
        """A free registered slot (allocated and registered on first need)."""
        if self._free:
            return self._free.popleft()
        self.allocated += 1
        raw = torch.empty(self.nbytes, dtype=torch.uint8, device=self._device)
        self._slots.append(self._engine.register(raw))
        return raw

    def give_back(self, raw: torch.Tensor) -> None:
        """Return a slot once its write has completed."""
        self._free.append(raw)

    def release(self, keep: set[int] = frozenset()) -> list[torch.Tensor]:
        """Unregister every slot except those whose address is in ``keep`` (returned, still
        registered: a read may still land in them).

        The engine outlives the pool: a slot freed while still registered leaves a stale region
        behind, and the next registration of memory the allocator hands out at that address
        fails ("overlapped memory region").
        """
        kept = [raw for raw in self._slots if raw.data_ptr() in keep]
        for raw in self._slots:
            if raw.data_ptr() not in keep:
                self._engine.unregister(raw)
        self._slots, self._free = [], deque()
        return kept
