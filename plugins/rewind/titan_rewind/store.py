"""Two snapshot slots: the last *stable* snapshot and the newest *pending* one.

A snapshot is taken after every ``interval`` healthy steps; it becomes stable once
``stable_after`` healthy steps followed it (a spike often builds up over a few steps, so the
newest copy may already hold the start of it). Then it replaces the previous stable one, whose
buffers take the next snapshot. While the pending snapshot is not stable yet, the next one
waits: the store never holds more than two, and never drops its only stable snapshot. With
``interval < stable_after`` snapshots are therefore ``stable_after`` steps apart.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from titan_plugins.settings import format_bytes
from titan_rewind.doctor import default_budget
from titan_rewind.snapshot import Slot, Snapshotter, planned_bytes  # imports torch


class SnapshotStore:
    """The stable and pending slots, the snapshot schedule and the host budget."""

    def __init__(self, interval: int, stable_after: int, budget: int | None) -> None:
        self.interval = interval
        self.stable_after = stable_after
        from titan_plugins.host_memory import Reservation

        self.budget = budget if budget else default_budget()
        # The plugins' shared host-memory ledger (act_offload's pool draws on it too).
        self.ledger = Reservation("rewind")
        self.stable = Slot()
        self.pending = Slot()
        self.snapshotter = Snapshotter()
        self.since_snapshot = 0  # healthy steps since the last snapshot (or restore)
        self.taken = 0
        self.no_snapshot: str = ""  # why no snapshot is taken (over budget, unsupported setup)
        self.planned: int = 0  # host bytes of one snapshot (0 until first planned)
        self.capture_seconds = 0.0
        self.recent_captures: deque[float] = deque(maxlen=100)  # seconds of the last captures

    # ------------------------------------------------------------------ schedule
    def on_healthy_step(self, step: int, chunks: list[Any], optimizer: Any, mark: int = 0) -> bool:
        """Count a healthy step: age the pending snapshot (promote it once stable) and take a
        new one when due, labelled ``step`` and carrying the caller's counter ``mark`` (the
        microbatches read so far). Returns whether a snapshot was taken."""
        self.since_snapshot += 1
        for slot in (self.stable, self.pending):
            if not slot.empty:
                slot.healthy_after += 1
        if not self.pending.empty and self.pending.healthy_after >= self.stable_after:
            self.stable, self.pending = self.pending, self.stable
            self.pending.clear()
        due = self.taken == 0 or self.since_snapshot >= self.interval
        if not due or not self.pending.empty or self.no_snapshot:
            return False
        if not self._fits(chunks, optimizer):
            return False
        self.snapshotter.capture(self.pending, step, chunks, optimizer)
        self.pending.mark = mark
        self.capture_seconds += self.pending.capture_seconds
        self.recent_captures.append(self.pending.capture_seconds)
        self.since_snapshot = 0
        self.taken += 1
        return True

    def _fits(self, chunks: list[Any], optimizer: Any) -> bool:
        if not self.planned:
            self.planned = planned_bytes(chunks, optimizer)
        need = 2 * self.planned
        if need <= self.budget and self.ledger.held >= need:
            return True
        if need <= self.budget and self.ledger.grow(need - self.ledger.held):
            return True
        if need <= self.budget:
            from titan_plugins import host_memory

            self.no_snapshot = (
                f"rewind: two snapshots of this rank need {format_bytes(need)} ({need} bytes) "
                "of host memory, over what the plugins' shared host-memory limit leaves "
                f"(TITAN_PLUGINS_MAX_HOST_BYTES; held now: {host_memory.usage()}); no snapshot "
                "is taken, so a fault cannot be rolled back. Raise the shared limit or lower "
                "another plugin's share (e.g. TITAN_ACT_OFFLOAD_MAX_HOST_BYTES)."
            )
            return False
        self.no_snapshot = (
            f"rewind: two snapshots of this rank need {format_bytes(need)} ({need} bytes) of "
            f"host memory, over the budget of {format_bytes(self.budget)}; no snapshot is "
            "taken, so a fault cannot be rolled back. Raise TITAN_REWIND_MAX_HOST_BYTES (or "
            "shard the optimizer state: more data-parallel ranks with the distributed optimizer)."
        )
        return False

    # ------------------------------------------------------------------ rollback
    def rollback_target(self) -> Slot | None:
        """The stable snapshot, if any."""
        return None if self.stable.empty else self.stable

    def restore(self, chunks: list[Any], optimizer: Any) -> Slot:
        """Restore the stable snapshot and drop the pending one (it may hold the fault's
        beginnings). The schedule restarts from the restored step."""
        slot = self.stable
        self.pending.synchronize()
        self.pending.clear()
        self.snapshotter.restore(slot, chunks, optimizer)
        self.since_snapshot = 0
        return slot

    def fence(self) -> None:
        """Before tensors are written (the optimizer step): wait for copies in flight."""
        self.pending.fence()
        self.stable.fence()

    # ------------------------------------------------------------------ reporting
    def held(self) -> list[Slot]:
        """Non-empty slots, oldest first."""
        return sorted((s for s in (self.stable, self.pending) if not s.empty), key=lambda s: s.step)

    def host_bytes(self) -> int:
        """Host bytes allocated for snapshots (both slots' buffers)."""
        return self.stable.nbytes() + self.pending.nbytes()

    def describe(self) -> dict[str, Any]:
        """Snapshots held (step, stable, age), bytes and budget."""
        now = time.time()
        return {
            "snapshots": [
                {
                    "step": slot.step,
                    "stable": slot is self.stable,
                    "healthy_steps_after": slot.healthy_after,
                    "age_s": round(now - slot.taken_at, 3),
                }
                for slot in self.held()
            ],
            "snapshots_taken": self.taken,
            "host_bytes": self.host_bytes(),
            "bytes_per_snapshot": self.planned,
            "host_budget": self.budget,
            "capture_s": round(self.capture_seconds, 6),
            "capture_ms_median": round(statistics.median(self.recent_captures) * 1e3, 3)
            if self.recent_captures
            else None,
            "no_snapshot": self.no_snapshot or None,
        }
