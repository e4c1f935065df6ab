"""Offload plan of one pipeline stage, on the core's model of megatron-core's schedule order.

A *unit* is one (model chunk, microbatch) forward whose saved activations live until the
matching backward. The schedule of a stage is a sequence of events ``F(unit)`` / ``B(unit)``
(:mod:`titan_plugins.hosts.megatron.schedule`, the project's one model of megatron's warm-up /
steady / cool-down order, checked against the real schedules there); the number of events between a
unit's forward and its backward (its *gap*) is how long its activations wait. The plan offloads
the units that wait at least ``min_gap`` events (longest first when a host budget limits how many
fit) and prefetches each offloaded unit at the start of the event just before its backward, in
the order the schedule runs backward. At run time ``Step`` checks each call against the plan.

``schedule_events`` and the names re-exported here keep this module's API for the plugin's
other modules (runtime, step, records, offloader) and the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from titan_plugins.hosts.megatron.schedule import (
    FORWARD,
    INTERLEAVED,
    KINDS,
    NO_PIPELINING,
    ONE_F_ONE_B,
    Event,
    Unit,
    live_peak,
    pipeline_schedule,
    schedule_table,
    unit_positions,
)

__all__ = [
    "INTERLEAVED",
    "KINDS",
    "NO_PIPELINING",
    "ONE_F_ONE_B",
    "Event",
    "OffloadPlan",
    "Unit",
    "build_plan",
    "schedule_events",
    "schedule_table",
]


def schedule_events(kind: str, *layout: Any, **options: Any) -> list[Event]:
    """The forward/backward order megatron-core runs on one pipeline rank, as a list.

    Same arguments as the core's
    :func:`~titan_plugins.hosts.megatron.schedule.pipeline_schedule`: ``kind`` (one of :data:`KINDS`), pipeline size and rank, microbatches, model chunks and the
    interleaved schedule's ``group_size`` (default the pipeline size, as megatron's config).
    Raises ValueError for a layout megatron refuses.
    """
    return list(pipeline_schedule(kind, *layout, **options).events)


def _sizes(unit_bytes: Mapping[Unit, int] | Callable[[Unit], int]) -> Callable[[Unit], int]:
    return unit_bytes if callable(unit_bytes) else (lambda u: unit_bytes.get(u, 0))


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
        return [e.unit for e in self.events if e.kind == FORWARD and chunk in (None, e.unit.chunk)]

    def in_flight_peak(self, chunk: int | None = None, kept_only: bool = False) -> int:
        """Most units (of ``chunk``) alive at once; ``kept_only``: not offloaded ones only."""
        return self.resident_peak(lambda u: 1, chunk=chunk, kept_only=kept_only)

    def resident_peak(
        self,
        unit_bytes: Mapping[Unit, int] | Callable[[Unit], int],
        chunk: int | None = None,
        kept_only: bool = True,
    ) -> int:
        """Peak of the summed ``unit_bytes`` of live units (kept ones with ``kept_only``)."""

        def kept(unit: Unit) -> bool:
            return chunk in (None, unit.chunk) and not (kept_only and unit in self.offload)

        return int(live_peak(self.events, _sizes(unit_bytes), kept))

    def host_peak(self, unit_bytes: Mapping[Unit, int] | Callable[[Unit], int]) -> int:
        """Peak host bytes the offloaded units occupy (held from forward to backward)."""
        return int(live_peak(self.events, _sizes(unit_bytes), self.offload.__contains__))


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
    forward_index, backward_index = unit_positions(events)
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
