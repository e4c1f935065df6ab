"""The order in which megatron-core's pipeline schedules run forwards and backwards.

One model for the whole project (the planner and the activation-offload plugin use it; the
trace generator keeps its own on purpose, as ground truth). A *unit* is the forward of one
microbatch through one model chunk (virtual pipeline stage) of a pipeline rank; its saved
activations live until the backward of the same unit. A rank's schedule is a sequence of
events ``F(unit)`` / ``B(unit)``:

- ``no_pipelining`` (``forward_backward_no_pipelining``): ``F0 B0 F1 B1 ...``.
- ``1f1b`` (``forward_backward_pipelining_without_interleaving``): ``pp - rank - 1`` warm-up
  forwards, then steady pairs ``F(k + warmup) B(k)``, then the cool-down backwards.
- ``interleaved`` (``forward_backward_pipelining_with_interleaving``): virtual microbatches
  follow megatron's schedule table (microbatches in groups of ``microbatch_group_size_per_vp_
  stage``, each group through every chunk in turn; the last group takes the rest); warm-up
  ``2 (pp - rank - 1) + (chunks - 1) group`` forwards (+1 with EP A2A overlap); the backward of
  table entry ``k`` runs chunk ``chunks - 1 - chunk_k`` on that chunk's oldest waiting microbatch.

With EP A2A overlap (``overlap_moe_expert_parallel_comm``) megatron runs each steady pair as one
combined step in which the forward and the backward interleave layer by layer; the events keep
the forward first, so peaks replayed from them are an upper bound for those steps.

Mirrors megatron-core's ``pipeline_parallel/schedules.py`` (``get_pp_rank_microbatches``,
``get_schedule_table``, the warm-up / steady / cool-down loops) and ``combined_1f1b.py``, whose
order is the same on every supported line (0.16-0.19); ``tests/test_schedule_model.py`` checks
it against the order the installed megatron really runs. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

NO_PIPELINING, ONE_F_ONE_B, INTERLEAVED = "no_pipelining", "1f1b", "interleaved"
KINDS = (NO_PIPELINING, ONE_F_ONE_B, INTERLEAVED)
FORWARD, BACKWARD = "F", "B"
WARMUP, STEADY, COOLDOWN = "warmup", "steady", "cooldown"


class Unit(NamedTuple):
    """The forward of ``microbatch`` through model chunk ``chunk`` (its virtual stage index on
    this rank) and, later, its backward."""

    chunk: int
    microbatch: int


class Event(NamedTuple):
    """``kind`` is :data:`FORWARD` (``"F"``) or :data:`BACKWARD` (``"B"``) of ``unit``."""

    kind: str
    unit: Unit


def schedule_kind(pp_size: int, num_chunks: int = 1) -> str:
    """The schedule megatron's ``get_forward_backward_func`` picks for this layout."""
    if pp_size > 1:
        return INTERLEAVED if num_chunks > 1 else ONE_F_ONE_B
    return NO_PIPELINING


def schedule_table(
    num_microbatches: int, num_chunks: int, group_size: int
) -> list[tuple[int, int]]:
    """``(microbatch, chunk)`` per virtual microbatch id, as megatron's ``get_schedule_table``."""
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group_size):
        end = num_microbatches if start + group_size >= num_microbatches else start + group_size
        table.extend((mb, chunk) for chunk in range(num_chunks) for mb in range(start, end))
    return table


def _check(
    kind: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    num_chunks: int,
    group_size: int,
    ep_overlap: bool,
) -> None:
    """Refuse what megatron-core refuses (ValueError naming the fix)."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {KINDS}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside pipeline size {pp_size}")
    if kind != INTERLEAVED and num_chunks != 1:
        raise ValueError(f"the {kind} schedule runs one model chunk, not {num_chunks}")
    if kind == ONE_F_ONE_B and ep_overlap:
        raise ValueError(
            "EP A2A overlap with pipelining needs the interleaved schedule (virtual stages)"
        )
    if kind != INTERLEAVED:
        return
    if not pp_size <= group_size <= num_microbatches:
        raise ValueError(
            f"interleaved schedule: the microbatch group size per virtual stage ({group_size}) "
            f"must lie in [PP={pp_size}, microbatches={num_microbatches}]"
        )
    last = num_microbatches % group_size
    if 0 < last < pp_size:
        raise ValueError(
            f"interleaved schedule: {num_microbatches} microbatches in groups of {group_size} "
            f"leave a last group of {last} < PP={pp_size} (megatron refuses: pipeline bubbles); "
            f"use a multiple of {group_size} microbatches, or a remainder >= {pp_size}"
        )


def _warmup(kind: str, pp_size: int, pp_rank: int, chunks: int, group: int, overlap: bool) -> int:
    """Megatron's warm-up forward count before capping (``get_pp_rank_microbatches``; with EP
    overlap the combined 1F1B runs one more, also without pipelining)."""
    if kind == NO_PIPELINING:
        return int(overlap)
    if kind == ONE_F_ONE_B:
        return pp_size - pp_rank - 1
    return 2 * (pp_size - pp_rank - 1) + (chunks - 1) * group + int(overlap)


@dataclass(frozen=True)
class Schedule:
    """The events one pipeline rank runs in one call of a megatron schedule.

    Build it with :func:`pipeline_schedule`. ``events`` holds the forwards and backwards in
    order; the first ``warmup`` events are the warm-up forwards, then ``2 * steady`` events
    alternate forward / backward, then the cool-down backwards.
    """

    kind: str
    pp_size: int
    pp_rank: int
    num_microbatches: int
    num_chunks: int
    group_size: int
    ep_overlap: bool
    forward_only: bool
    warmup: int
    events: tuple[Event, ...]
    _forward_at: dict[Unit, int] = field(default_factory=dict, repr=False, compare=False)
    _backward_at: dict[Unit, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        forward_at, backward_at = unit_positions(self.events, complete=not self.forward_only)
        self._forward_at.update(forward_at)
        self._backward_at.update(backward_at)

    @property
    def steady(self) -> int:
        """Steady-state forward/backward pairs (0 for a forward-only pass)."""
        return 0 if self.forward_only else len(self._forward_at) - self.warmup

    def phase(self, index: int) -> str:
        """:data:`WARMUP`, :data:`STEADY` or :data:`COOLDOWN` of event ``index``."""
        if index < self.warmup:
            return WARMUP
        return STEADY if index < self.warmup + 2 * self.steady else COOLDOWN

    def units(self, chunk: int | None = None) -> list[Unit]:
        """The units (of ``chunk``, or all) in forward order."""
        return [u for u in self._forward_at if chunk in (None, u.chunk)]

    def forward_index(self, unit: Unit) -> int:
        """Position of the unit's forward in :attr:`events`."""
        return self._forward_at[unit]

    def backward_index(self, unit: Unit) -> int:
        """Position of the unit's backward in :attr:`events`."""
        return self._backward_at[unit]

    def gap(self, unit: Unit) -> int:
        """Events between the unit's forward and its backward (how long its activations wait)."""
        return self._backward_at[unit] - self._forward_at[unit] - 1

    def in_flight_peak(self, chunk: int | None = None) -> int:
        """Most units (of ``chunk``) whose activations are alive at once."""
        return int(live_peak(self.events, lambda u: 1, lambda u: chunk in (None, u.chunk)))


def unit_positions(
    events: Sequence[Event], complete: bool = True
) -> tuple[dict[Unit, int], dict[Unit, int]]:
    """``(forward index, backward index)`` of every unit of ``events``.

    :param complete: require exactly one backward per forward (a training step); False allows
        a forward-only pass.
    :raises ValueError: a unit runs its forward or backward twice, or (``complete``) lacks one.
    """
    forward_at: dict[Unit, int] = {}
    backward_at: dict[Unit, int] = {}
    for index, event in enumerate(events):
        table = forward_at if event.kind == FORWARD else backward_at
        if event.unit in table:
            raise ValueError(f"{event.kind}{tuple(event.unit)} appears twice in the schedule")
        table[event.unit] = index
    if (complete or backward_at) and set(forward_at) != set(backward_at):
        raise ValueError("every unit needs exactly one forward and one backward event")
    return forward_at, backward_at


def replay(events: Sequence[Event]) -> Iterator[tuple[Event, list[Unit]]]:
    """Each event with the units alive right after it, oldest forward first.

    Saved activations only grow during forwards and only shrink during backwards, so a peak
    of anything summed over the live units is reached right after some forward.
    """
    live: list[Unit] = []
    for event in events:
        if event.kind == FORWARD:
            live.append(event.unit)
        else:
            live.remove(event.unit)
        yield event, list(live)


def live_peak(
    events: Sequence[Event],
    size: Callable[[Unit], float],
    include: Callable[[Unit], bool] | None = None,
) -> float:
    """Peak over ``events`` of the summed ``size`` of the live units (those ``include`` keeps)."""
    live = peak = 0.0
    for event in events:
        if include is not None and not include(event.unit):
            continue
        live += size(event.unit) if event.kind == FORWARD else -size(event.unit)
        peak = max(peak, live)
    return peak


def pipeline_schedule(
    kind: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    num_chunks: int = 1,
    group_size: int | None = None,
    *,
    ep_overlap: bool = False,
    forward_only: bool = False,
) -> Schedule:
    """The schedule megatron-core runs on pipeline rank ``pp_rank``.

    :param kind: one of :data:`KINDS` (see :func:`schedule_kind`).
    :param num_chunks: model chunks (virtual stages) per rank; > 1 only for ``interleaved``.
    :param group_size: the interleaved schedule's ``microbatch_group_size_per_vp_stage``
        (default ``pp_size``, as megatron's config).
    :param ep_overlap: ``overlap_moe_expert_parallel_comm`` (combined 1F1B: one more warm-up
        forward; with pipelining only under ``interleaved``).
    :param forward_only: an evaluation pass: every forward in order, no backward.
    :raises ValueError: for a layout megatron-core refuses, naming the fix.
    """
    group = group_size or pp_size
    _check(kind, pp_size, pp_rank, num_microbatches, num_chunks, group, ep_overlap)
    if kind == INTERLEAVED:
        table = schedule_table(num_microbatches, num_chunks, group)
        forwards = [Unit(chunk, mb) for mb, chunk in table]
        # Backward k runs the mirrored chunk; each chunk's backwards take its microbatches in
        # forward order (megatron pops the oldest stored output), which the table gives.
        backwards = [Unit(num_chunks - 1 - chunk, mb) for mb, chunk in table]
    else:
        forwards = [Unit(0, mb) for mb in range(num_microbatches)]
        backwards = list(forwards)
    if forward_only:
        warmup, events = len(forwards), [Event(FORWARD, u) for u in forwards]
    else:
        warmup = min(_warmup(kind, pp_size, pp_rank, num_chunks, group, ep_overlap), len(forwards))
        events = [Event(FORWARD, u) for u in forwards[:warmup]]
        for k in range(len(forwards) - warmup):
            events += [Event(FORWARD, forwards[warmup + k]), Event(BACKWARD, backwards[k])]
        events += [Event(BACKWARD, u) for u in backwards[len(forwards) - warmup :]]
    return Schedule(
        kind,
        pp_size,
        pp_rank,
        num_microbatches,
        num_chunks,
        group,
        ep_overlap,
        forward_only,
        warmup,
        tuple(events),
    )
