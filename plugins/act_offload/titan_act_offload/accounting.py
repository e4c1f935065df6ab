"""Byte accounting of saved activations: what is device-resident now and at peak, per model chunk
and for the whole stage, what the same tensors would occupy without offload, what moved between
device and host, and why tensors were left alone.

"Device-resident" counts the saved tensors of the selected blocks that are on the device: kept
(not offloaded), staged (waiting for their block to finish before the copy), and reloaded (back
on the device, not yet handed to autograd). "Live" counts the same tensors from their save to
their last use whether or not they moved: its peak is the no-offload baseline of the same run.
"Stage" adds what the forward saved outside the selected blocks (norms, embedding, loss; never
moved) and the saved tensors left in place (data, masks, indices, norm statistics, the stage's
received input; counted until their unit's backward ends; parameters are not activations):
``peak_stage`` is the whole stage's saved-activation peak with offload, ``peak_stage_live`` the
same without.
On CPU "device" and "host" are both CPU memory; the copies are real memcpys into the host pool,
and the numbers are exact.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OffloadStats:
    """Counters read by tests, benchmarks and ``titan_report``."""

    resident: int = 0
    peak_resident: int = 0
    kept: int = 0  # resident bytes of records that were never offloaded
    peak_kept: int = 0
    live: int = 0  # block bytes between save and last use, wherever they are
    peak_live: int = 0  # = the device-resident peak with no offload (same tensors, same run)
    outside: int = 0  # device bytes saved outside the selected blocks (never moved)
    pinned: int = 0  # bytes of saved tensors left in place (skipped), until their unit's backward
    stage: int = 0  # resident + outside: every saved activation of the stage on the device
    peak_stage: int = 0
    stage_live: int = 0  # live + outside
    peak_stage_live: int = 0  # the whole stage's saved-activation peak without offload
    resident_by_chunk: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    peak_by_chunk: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    kept_by_chunk: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    peak_kept_by_chunk: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    max_block_bytes: int = 0  # largest block (one module forward of one unit)
    saved_bytes: int = 0  # bytes of distinct tensors packed (deduplicated per unit)
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0  # reloaded ahead of use (by the plan)
    late_reload_bytes: int = 0  # reloaded on demand at unpack
    prefetch_hits: int = 0  # blocks whose reload was issued before their first unpack
    late_reloads: int = 0  # blocks reloaded only when backward asked for them
    kept_over_budget_bytes: int = 0  # left on the device because the host budget was reached
    skipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # reason -> count
    skipped_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    steps: int = 0
    schedule_mismatches: int = 0
    unit_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # last step, per unit

    def skip(self, reason: str, nbytes: int) -> None:
        """A saved tensor of ``nbytes`` stays where it is, because of ``reason``."""
        self.skipped[reason] += 1
        self.skipped_bytes[reason] += nbytes

    def add(self, chunk: int, nbytes: int, kept: bool) -> None:
        """``nbytes`` became device-resident in ``chunk`` (``kept``: not headed to host)."""
        self._stage(nbytes)
        self.resident += nbytes
        self.resident_by_chunk[chunk] += nbytes
        self.peak_resident = max(self.peak_resident, self.resident)
        self.peak_by_chunk[chunk] = max(self.peak_by_chunk[chunk], self.resident_by_chunk[chunk])
        if kept:
            self.kept += nbytes
            self.kept_by_chunk[chunk] += nbytes
            self.peak_kept = max(self.peak_kept, self.kept)
            self.peak_kept_by_chunk[chunk] = max(
                self.peak_kept_by_chunk[chunk], self.kept_by_chunk[chunk]
            )

    def remove(self, chunk: int, nbytes: int, kept: bool) -> None:
        """``nbytes`` of ``chunk`` left the device (copied out, or handed to autograd)."""
        self._stage(-nbytes)
        self.resident -= nbytes
        self.resident_by_chunk[chunk] -= nbytes
        if kept:
            self.kept -= nbytes
            self.kept_by_chunk[chunk] -= nbytes

    def born(self, nbytes: int) -> None:
        """A tensor of a selected block was saved (the no-offload baseline grows)."""
        self.live += nbytes
        self.peak_live = max(self.peak_live, self.live)
        self._stage_live(nbytes)

    def died(self, nbytes: int) -> None:
        """A tensor of a selected block was used for the last time (or its saver died)."""
        self.live -= nbytes
        self._stage_live(-nbytes)

    def pin(self, nbytes: int) -> None:
        """A saved tensor stays in place (skipped) until its unit's backward: it counts in the
        stage's figures with and without offload."""
        self.pinned += nbytes
        self._stage(nbytes)
        self._stage_live(nbytes)

    def unpin(self, nbytes: int) -> None:
        """The unit's backward ran: its skipped tensors are no longer needed."""
        self.pinned -= nbytes
        self._stage(-nbytes)
        self._stage_live(-nbytes)

    def _stage(self, nbytes: int) -> None:
        self.stage += nbytes
        self.peak_stage = max(self.peak_stage, self.stage)

    def _stage_live(self, nbytes: int) -> None:
        self.stage_live += nbytes
        self.peak_stage_live = max(self.peak_stage_live, self.stage_live)

    # ----- per record (a ``records.Record``: its flags say what it is counted in) -------------
    def enter(self, record: Any, kept: bool) -> None:
        """``record`` is on the device now (``kept``: and stays there)."""
        if record.resident:
            return
        record.resident, record.kept = True, kept
        if record.block.outside:
            self.outside += record.nbytes
            self._stage(record.nbytes)
        else:
            self.add(record.block.unit.unit.chunk, record.nbytes, kept)

    def leave(self, record: Any) -> None:
        """``record`` is no longer on the device (copied out, or handed to autograd)."""
        if not record.resident:
            return
        record.resident = False
        if record.block.outside:
            self.outside -= record.nbytes
            self._stage(-record.nbytes)
        else:
            self.remove(record.block.unit.unit.chunk, record.nbytes, record.kept)

    def saved(self, record: Any) -> None:
        """``record`` was saved: it is live until :meth:`end_of_life`."""
        if record.block.outside:
            self._stage_live(record.nbytes)
        else:
            self.saved_bytes += record.nbytes
            self.born(record.nbytes)

    def keep(self, record: Any, reason: str) -> None:
        """``record`` was headed to host but stays on the device because of ``reason``."""
        self.leave(record)
        self.enter(record, kept=True)
        self.skip(reason, record.nbytes)

    def end_of_life(self, record: Any) -> None:
        """``record`` was used for the last time (or nothing can use it any more)."""
        self.leave(record)
        if record.live:
            record.live = False
            if record.block.outside:
                self._stage_live(-record.nbytes)
            else:
                self.died(record.nbytes)

    def reset_peaks(self) -> None:
        """Start a new measurement window (peaks restart from the current values)."""
        self.peak_resident = self.resident
        self.peak_kept = self.kept
        self.peak_live = self.live
        self.peak_stage = self.stage
        self.peak_stage_live = self.stage_live
        self.peak_by_chunk = defaultdict(int, self.resident_by_chunk)
        self.peak_kept_by_chunk = defaultdict(int, self.kept_by_chunk)

    def as_dict(self) -> dict[str, Any]:
        """Plain-data snapshot (picklable, JSON-friendly keys)."""
        return {
            "resident": self.resident,
            "peak_resident": self.peak_resident,
            "kept": self.kept,
            "peak_kept": self.peak_kept,
            "live": self.live,
            "peak_live": self.peak_live,
            "outside": self.outside,
            "pinned": self.pinned,
            "stage": self.stage,
            "peak_stage": self.peak_stage,
            "stage_live": self.stage_live,
            "peak_stage_live": self.peak_stage_live,
            "peak_by_chunk": dict(self.peak_by_chunk),
            "peak_kept_by_chunk": dict(self.peak_kept_by_chunk),
            "max_block_bytes": self.max_block_bytes,
            "saved_bytes": self.saved_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "prefetched_bytes": self.prefetched_bytes,
            "late_reload_bytes": self.late_reload_bytes,
            "prefetch_hits": self.prefetch_hits,
            "late_reloads": self.late_reloads,
            "kept_over_budget_bytes": self.kept_over_budget_bytes,
            "skipped": dict(self.skipped),
            "skipped_bytes": dict(self.skipped_bytes),
            "steps": self.steps,
            "schedule_mismatches": self.schedule_mismatches,
            "unit_bytes": dict(self.unit_bytes),
        }
