"""Byte accounting of saved activations: what is device-resident now and at peak, per model chunk
and for the whole stage, and what moved between device and host.

"Device-resident" counts the saved tensors the offloader holds on the device: kept (not
offloaded), staged (waiting for their block to finish before the copy), and reloaded (back on
the device, not yet handed to autograd). On CPU "device" and "host" are both CPU memory; the
copies are real memcpys into the host pool, and the numbers are exact.
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
    skipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    steps: int = 0
    schedule_mismatches: int = 0
    unit_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # last step, per unit

    def add(self, chunk: int, nbytes: int, kept: bool) -> None:
        """``nbytes`` became device-resident in ``chunk`` (``kept``: not headed to host)."""
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
        self.resident -= nbytes
        self.resident_by_chunk[chunk] -= nbytes
        if kept:
            self.kept -= nbytes
            self.kept_by_chunk[chunk] -= nbytes

    def reset_peaks(self) -> None:
        """Start a new measurement window (peaks restart from the current values)."""
        self.peak_resident = self.resident
        self.peak_kept = self.kept
        self.peak_by_chunk = defaultdict(int, self.resident_by_chunk)
        self.peak_kept_by_chunk = defaultdict(int, self.kept_by_chunk)

    def as_dict(self) -> dict[str, Any]:
        """Plain-data snapshot (picklable, JSON-friendly keys)."""
        return {
            "resident": self.resident,
            "peak_resident": self.peak_resident,
            "kept": self.kept,
            "peak_kept": self.peak_kept,
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
            "steps": self.steps,
            "schedule_mismatches": self.schedule_mismatches,
            "unit_bytes": dict(self.unit_bytes),
        }
