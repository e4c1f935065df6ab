"""Two snapshot slots: the last *stable* snapshot and the newest *pending* one.

The first snapshot is the *starting state* (:meth:`SnapshotStore.capture_start`): the model and
optimizer as loaded, taken before the first update. It is stable by definition (no update can
have spoiled it), so it goes into the stable slot at once and a fault in the very first steps
rolls back to it; the first regular snapshot replaces it once that one is stable.

A snapshot is taken after every ``interval`` healthy steps (the first after step 0, and again
after a rollback to the starting state); it becomes stable once
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

from titan_plugins.settings import describe_bytes, format_bytes
from titan_rewind.budget import default_budget
from titan_rewind.snapshot import START, Early, Slot, Snapshotter, plan  # imports torch


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
        self.no_snapshot_reason: str = ""  # the same in short, for a job-wide message
        self.no_snapshot_knobs: tuple[str, ...] = ()  # knobs that would lift that refusal
        self.planned: int = 0  # host bytes of one snapshot (the latest planned; 0 before)
        self.regular_taken = False  # a snapshot after a step since the start (or its restore)
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
        due = not self.regular_taken or self.since_snapshot >= self.interval
        if not due or not self.pending.empty or self.no_snapshot:
            return False
        if not self._fits(chunks, optimizer):
            return False
        self._capture(self.pending, step, chunks, optimizer, mark)
        self.regular_taken = True
        return True

    def capture_start(
        self, chunks: list[Any], optimizer: Any, early: Early | None = None, mark: int = 0
    ) -> bool:
        """Take the starting state into the stable slot: call it before the first update
        (parameters, masters and optimizer state as loaded), with ``early`` taken before the
        first forward (buffers, RNG). Returns whether it was taken."""
        if self.no_snapshot or not self._fits(chunks, optimizer):
            return False
        self._capture(self.stable, START, chunks, optimizer, mark, early)
        self.pending.clear()
        self.regular_taken = False
        return True

    def _capture(
        self,
        slot: Slot,
        step: int,
        chunks: list[Any],
        optimizer: Any,
        mark: int,
        early: Early | None = None,
    ) -> None:
        self.snapshotter.capture(slot, step, chunks, optimizer, early)
        slot.mark = mark
        self.capture_seconds += slot.capture_seconds
        self.recent_captures.append(slot.capture_seconds)
        self.since_snapshot = 0
        self.taken += 1

    def _fits(self, chunks: list[Any], optimizer: Any) -> bool:
        """Whether two snapshots fit the budget and the plugins' shared ledger (reserving them
        there); otherwise set ``no_snapshot`` (why, and the knobs that would lift it). Planned
        at every capture (the optimizer state may grow)."""
        self.planned, full, exact = plan(chunks, optimizer)
        # Two snapshots as they will be once the optimizer has its state (Adam's moments appear
        # at the first update): checked and reserved from the starting state on, so the budget
        # is known at step 0 and later snapshots do not find it short.
        need = 2 * full
        if need <= self.budget and (
            self.ledger.held >= need or self.ledger.grow(need - self.ledger.held)
        ):
            return True
        from titan_plugins import host_memory

        usage = host_memory.usage()
        others = {k: v for k, v in usage.items() if k not in ("rewind", "total", "limit")}
        shared_need = sum(others.values()) + need
        size = f"{'' if exact else 'at least '}{describe_bytes(need)}"
        later = ""
        if full > self.planned:
            later = " (with the Adam moments the first update creates)"
        if not exact:
            later = " (more once the optimizer creates its state at the first update)"
        if need > self.budget:
            knobs = ["TITAN_REWIND_MAX_HOST_BYTES"]
            advice = f"TITAN_REWIND_MAX_HOST_BYTES >= {format_bytes(need)}"
            if shared_need > usage["limit"]:
                knobs.append("TITAN_PLUGINS_MAX_HOST_BYTES")
                advice += f" and TITAN_PLUGINS_MAX_HOST_BYTES >= {format_bytes(shared_need)}"
            advice += (
                " (or shard the optimizer state: more data-parallel ranks with the distributed "
                "optimizer)"
            )
            why = (
                f"two snapshots of this rank need {size} of host memory{later}, over the rewind "
                f"budget of {format_bytes(self.budget)} (TITAN_REWIND_MAX_HOST_BYTES)"
            )
        else:
            knobs = ["TITAN_PLUGINS_MAX_HOST_BYTES"]
            knobs += [f"TITAN_{owner.upper()}_MAX_HOST_BYTES" for owner in others]
            advice = f"TITAN_PLUGINS_MAX_HOST_BYTES >= {format_bytes(shared_need)}"
            if others:
                advice += " or a smaller share for " + ", ".join(
                    f"{owner} (TITAN_{owner.upper()}_MAX_HOST_BYTES, holds {format_bytes(held)})"
                    for owner, held in others.items()
                )
            why = (
                f"two snapshots of this rank need {size} of host memory{later}, over what the "
                f"plugins' shared host-memory limit of {format_bytes(usage['limit'])} leaves "
                f"(TITAN_PLUGINS_MAX_HOST_BYTES; held now: {host_memory.held_text()})"
            )
        held = self.rollback_target()
        then = (
            f"no further snapshot is taken; a fault rolls back to {held.label()}"
            if held is not None
            else "no snapshot is taken, so a fault cannot be rolled back"
        )
        self.no_snapshot = f"rewind: {why}; {then}. Would help: {advice}."
        self.no_snapshot_reason = f"{why}; would help: {advice}"
        self.no_snapshot_knobs = tuple(knobs)
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
        if slot.start:  # back at the start: the schedule starts over (next healthy step)
            self.regular_taken = False
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
                    "start": slot.start,
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
