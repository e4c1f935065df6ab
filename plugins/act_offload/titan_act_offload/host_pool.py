"""Host buffer pool for offloaded activations: pinned when the device supports it, reused across
steps, and capped by a byte budget (past it, callers keep the tensor on the device).

Buffers are flat ``uint8`` tensors bucketed by size (8 buckets per power of two, at most 12.5%
slack), because MoE expert inputs change size from microbatch to microbatch and exact-size
buckets would never be reused.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def bucket_bytes(nbytes: int) -> int:
    """Round ``nbytes`` up to its pool bucket (multiple of 512, 8 buckets per octave)."""
    if nbytes <= 4096:
        return max(512, -(-nbytes // 512) * 512)
    step = 1 << (nbytes.bit_length() - 4)  # 1/8 of the enclosing power of two
    return -(-nbytes // step) * step


class HostBufferPool:
    """Size-bucketed pool of host byte buffers with a capacity budget.

    :param budget: most bytes the pool may hold (free + in use); ``None`` for no limit.
    :param pin: allocate page-locked buffers (only meaningful with an accelerator).
    """

    def __init__(self, budget: int | None = None, pin: bool = False) -> None:
        from titan_plugins.host_memory import Reservation

        self.budget = budget
        self.pin = pin
        # The plugins' shared host-memory ledger: rewind's snapshots and others draw on it too.
        self._ledger = Reservation("act_offload")
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.capacity = 0  # bytes allocated by the pool (free or in use)
        self.in_use = 0  # bytes handed out and not yet released
        self.peak_in_use = 0
        self.allocations = 0  # buffers created
        self.reuses = 0  # acquisitions served from the free lists
        self.refusals = 0  # acquisitions refused by the budget
        self.shared_refusals = 0  # of which refused by the plugins' shared host-memory limit

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A host byte buffer of at least ``nbytes`` bytes, or None if the budget forbids it."""
        size = bucket_bytes(nbytes)
        free = self._free.get(size)
        if free:
            buffer = free.pop()
            self.reuses += 1
        else:
            if self.budget is not None and self.capacity + size > self.budget:
                if not self._evict_for(size):
                    self.refusals += 1
                    return None
            if not self._ledger.grow(size):
                self._drop_free()  # the shared limit: give back idle buffers and try once more
                if not self._ledger.grow(size):
                    self.refusals += 1
                    self.shared_refusals += 1
                    return None
            buffer = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            self.capacity += size
            self.allocations += 1
        self.in_use += size
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer from :meth:`acquire` back for reuse."""
        size = buffer.numel()
        self.in_use -= size
        self._free[size].append(buffer)

    def _evict_for(self, size: int) -> bool:
        # Free buffers of other sizes are dropped (largest first) to make room within budget.
        assert self.budget is not None
        for key in sorted(self._free, reverse=True):
            while self._free[key] and self.capacity + size > self.budget:
                self._free[key].pop()
                self.capacity -= key
                self._ledger.shrink(key)
        return self.capacity + size <= self.budget

    def clear(self) -> None:
        """Drop every free buffer (buffers in use stay valid)."""
        self._drop_free()

    def _drop_free(self) -> None:
        for key, buffers in self._free.items():
            self.capacity -= key * len(buffers)
            self._ledger.shrink(key * len(buffers))
        self._free.clear()

    def stats(self) -> dict[str, int]:
        """Counters for reports and tests."""
        return {
            "capacity": self.capacity,
            "in_use": self.in_use,
            "peak_in_use": self.peak_in_use,
            "allocations": self.allocations,
            "reuses": self.reuses,
            "refusals": self.refusals,
            "shared_refusals": self.shared_refusals,
        }
