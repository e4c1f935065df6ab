"""Offload plan of one pipeline stage, derived from megatron-core's schedule order.

A *unit* is one (model chunk, microbatch) forward whose saved activations live until the
matching backward. The schedule of a stage is a sequence of events ``F(unit)`` / ``B(unit)``;
the number of events between a unit's forward and its backward (its *gap*) is how long its
activations wait. The plan offloads the units that wait at least ``min_gap`` events (longest
first when a host budget limits how many fit) and prefetches each offloaded unit at the start
of the event just before its backward, in the order the schedule runs backward.

Pure Python: the orders mirror megatron-core 0.16.1 ``schedules.py`` (``get_pp_rank_microbatches``,
``get_schedule_table``, the warmup / steady 1F1B / cooldown loops) and are checked against the real
schedule at run time (``Step.mismatches``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

NO_PIPELINING, ONE_F_ONE_B, INTERLEAVED = "no_pipelining", "1f1b", "interleaved"
KINDS = (NO_PIPELINING, ONE_F_ONE_B, INTERLEAVED)


class Unit(NamedTuple):
    """One forward of ``microbatch`` through model chunk ``chunk`` (virtual stage)."""

    chunk: int
    microbatch: int


class Event(NamedTuple):
    """``kind`` is ``"F"`` (forward) or ``"B"`` (backward) of ``unit``."""

    kind: str
    unit: Unit


def schedule_table(
    num_microbatches: int, num_chunks: int, group_size: int
) -> list[tuple[int, int]]:
    """(microbatch, chunk) per virtual microbatch id, as megatron's ``get_schedule_table``."""
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group_size):
        end = num_microbatches if start + group_size >= num_microbatches else start + group_size
        table.extend((mb, chunk) for chunk in range(num_chunks) for mb in range(start, end))
    return table


def schedule_events(
    kind: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    num_chunks: int = 1,
    group_size: int | None = None,
) -> list[Event]:
    """The forward/backward order megatron-core runs on pipeline rank ``pp_rank``.

    ``kind`` is one of :data:`KINDS`. ``group_size`` is the interleaved schedule's
    ``microbatch_group_size_per_vp_stage`` (default ``pp_size``, as megatron's config).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {KINDS}")
    if num_microbatches < 1:
        raise ValueError("num_microbatches must be >= 1")
    if kind == NO_PIPELINING:
        events: list[Event] = []
        for mb in range(num_microbatches):
            events += [Event("F", Unit(0, mb)), Event("B", Unit(0, mb))]
        return events
    if kind == ONE_F_ONE_B:
        fwd = [Unit(0, mb) for mb in range(num_microbatches)]
        bwd = list(fwd)
        warmup = min(pp_size - pp_rank - 1, num_microbatches)
    else:
        group_size = group_size or pp_size
        table = schedule_table(num_microbatches, num_chunks, group_size)
        fwd = [Unit(chunk, mb) for mb, chunk in table]
        # Backward k runs chunk (V-1-chunk_k) on that chunk's next microbatch (FIFO per chunk).
        bwd = [Unit(num_chunks - 1 - chunk, mb) for mb, chunk in table]
        warmup = (pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * group_size
        warmup = min(warmup, len(fwd))
    events = [Event("F", u) for u in fwd[:warmup]]
    for k in range(len(fwd) - warmup):
        events += [Event("F", fwd[warmup + k]), Event("B", bwd[k])]
    events += [Event("B", u) for u in bwd[len(fwd) - warmup :]]
    return events


@dataclass
class OffloadPlan:
    """Which units of a stage go to host memory, and when each comes back."""

    events: list[Event]
    offload: frozenset[Unit]
    prefetch_at: dict[int, list[Unit]] = field(default_factory=dict)
    forward_index: dict[Unit, int] = field(default_factory=dict)
    backward_index: dict[Unit, int] = field(default_factory=dict)

    def gap(self, unit: Unit) -> int:
        """Events between the unit's forward and its backward."""
        return self.backward_index[unit] - self.forward_index[unit] - 1

    def units(self, chunk: int | None = None) -> list[Unit]:
        """The units in forward order (of one chunk, or all)."""
        return [e.unit for e in self.events if e.kind == "F" and chunk in (None, e.unit.chunk)]

    def in_flight_peak(self, chunk: int | None = None, kept_only: bool = False) -> int:
        """Most units (of ``chunk``) alive at once; ``kept_only``: not offloaded ones only."""
        return self.resident_peak(lambda u: 1, chunk=chunk, kept_only=kept_only)

    def resident_peak(
        self,
        unit_bytes: Mapping[Unit, int] | Callable[[Unit], int],
        chunk: int | None = None,
        kept_only: bool = True,
    ) -> int:
        """Peak of the summed ``unit_bytes`` of live units (kept ones with ``kept_only``).

        Saved bytes only grow during forwards and only shrink during backwards, so the peak is
        reached at the end of a forward event: that is what this replays.
        """
        size = unit_bytes if callable(unit_bytes) else (lambda u: unit_bytes.get(u, 0))
        live, peak = 0, 0
        for event in self.events:
            unit = event.unit
            if chunk is not None and unit.chunk != chunk:
                continue
            if kept_only and unit in self.offload:
                continue
            live += size(unit) if event.kind == "F" else -size(unit)
            peak = max(peak, live)
        return peak

    def host_peak(self, unit_bytes: Mapping[Unit, int] | Callable[[Unit], int]) -> int:
        """Peak host bytes the offloaded units occupy (held from forward to backward)."""
        size = unit_bytes if callable(unit_bytes) else (lambda u: unit_bytes.get(u, 0))
        live, peak = 0, 0
        for event in self.events:
            if event.unit in self.offload:
                live += size(event.unit) if event.kind == "F" else -size(event.unit)
                peak = max(peak, live)
        return peak


def build_plan(
    events: list[Event],
    min_gap: int = 1,
    unit_bytes: Mapping[Unit, int] | None = None,
    host_budget: int | None = None,
) -> OffloadPlan:
    """Offload every unit that waits ``>= min_gap`` events, longest waits first.

    With ``unit_bytes`` (measured on an earlier step) and ``host_budget``, units are added in
    order of decreasing gap only while the host peak stays within the budget, so the units that
    wait longest (the biggest device saving per host byte-second) are the ones offloaded.
    """
    if min_gap < 0:
        raise ValueError("min_gap must be >= 0")
    forward_index: dict[Unit, int] = {}
    backward_index: dict[Unit, int] = {}
    for index, event in enumerate(events):
        table = forward_index if event.kind == "F" else backward_index
        if event.unit in table:
            raise ValueError(f"{event.kind}{tuple(event.unit)} appears twice in the schedule")
        table[event.unit] = index
    if set(forward_index) != set(backward_index):
        raise ValueError("every unit needs exactly one forward and one backward event")
    plan = OffloadPlan(events, frozenset(), {}, forward_index, backward_index)
    candidates = [u for u in forward_index if plan.gap(u) >= min_gap]
    candidates.sort(key=lambda u: (-plan.gap(u), forward_index[u]))
    chosen: set[Unit] = set()
    for unit in candidates:
        chosen.add(unit)
        if host_budget is not None and unit_bytes is not None:
            plan.offload = frozenset(chosen)
            if plan.host_peak(unit_bytes) > host_budget:
                chosen.discard(unit)
    plan.offload = frozenset(chosen)
    for unit in sorted(chosen, key=backward_index.__getitem__):
        # Prefetch during the event before the backward; a unit whose backward follows its own
        # forward (gap 0) is prefetched when its backward starts.
        at = backward_index[unit] - 1
        if at <= forward_index[unit]:
            at = backward_index[unit]
        plan.prefetch_at.setdefault(at, []).append(unit)
    return plan
