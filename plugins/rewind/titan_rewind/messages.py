"""What rewind tells the job: a rollback, nothing to roll back to, or giving up.

Each message is built from every rank's answer (gathered by :mod:`titan_rewind.collective` in
the state machine), so rank 0 says it once for the job and names each rank's reason and the
knobs that would have helped; the other ranks raise one line pointing at rank 0's message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_rewind.detect import Trigger
    from titan_rewind.store import SnapshotStore


def rank_ranges(ranks: Sequence[int]) -> str:
    """``0-3`` for a run of three or more ranks, else ``1, 3``."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def grouped(per_rank: Sequence[Any]) -> tuple[list[str], list[int], list[str]]:
    """Lines ``rank(s) R: text`` for the ranks whose entry is ``(text, knobs)`` (None: fine),
    those ranks, and the knobs named, in order."""
    groups: dict[str, list[int]] = {}
    knobs: list[str] = []
    for rank, entry in enumerate(per_rank):
        if entry is None:
            continue
        text, named = entry
        groups.setdefault(text, []).append(rank)
        knobs += [k for k in named if k not in knobs]
    lines = [f"  rank(s) {rank_ranges(ranks)}: {text}" for text, ranks in groups.items()]
    return lines, sorted(r for ranks in groups.values() for r in ranks), knobs


def no_target_reason(
    store: SnapshotStore, no_model: bool, stable_after: int
) -> tuple[str, tuple[str, ...]]:
    """Why a rank holds nothing to roll back to, and the knobs that would lift it."""
    if store.no_snapshot:
        text = store.no_snapshot_reason or store.no_snapshot.removeprefix("rewind: ")
        return text, store.no_snapshot_knobs
    if no_model:
        return (
            "no model chunks were known at the optimizer step (the step was not preceded "
            "by a megatron forward-backward call, and the optimizer has no model_chunks)",
            (),
        )
    return (
        "no starting state is held and no snapshot has had "
        f"{stable_after} healthy steps after it yet",
        ("TITAN_REWIND_STABLE_AFTER", "TITAN_REWIND_INTERVAL"),
    )


def targets_missing(index: int, count: int, size: int, lines: list[str]) -> str:
    """Rank 0's notice when some ranks newly hold nothing to roll back to."""
    return "\n".join(
        [
            f"rewind: step {index}: nothing to roll back to on {count} of {size} "
            "rank(s): a NaN/Inf would stop the run, a spike would only be reported:",
            *lines,
        ]
    )


def cannot_roll_back(
    trigger: Trigger,
    index: int,
    lines: list[str],
    ranks: list[int],
    size: int,
    knobs: list[str],
) -> tuple[str, str]:
    """(the head line, the knobs line) of a trigger that found nothing to roll back to."""
    head = (
        f"rewind: step {index}: {trigger.describe()}, and nothing to roll back to on "
        f"{len(ranks)} of {size} rank(s)"
    )
    helped = (
        f"knobs that would have helped: {', '.join(knobs)}"
        if knobs
        else "no rewind knob would have helped (see the reason above)"
    )
    return head, helped


def stop_elsewhere(index: int, kind: str, what: str, points: str) -> str:
    """The one line a rank other than 0 raises when the job stops (rank 0 says why)."""
    return (
        f"rewind: step {index}: {kind}, {what}; stopping "
        f"(rank 0 raised the job's message: {points})"
    )


def give_up(
    trigger: Trigger,
    index: int,
    level: int,
    window: int,
    steps: list[int],
    snapshot_step: int,
    skip_problems: list[str],
    recent: Sequence[str] = (),
) -> tuple[str, list[str]]:
    """Rank 0's message for fault number ``max_rewinds + 1`` in one chain, and its knobs; it
    leads with the ``recent`` lines (the last steps' losses and grad norms)."""
    target = (
        "the starting state (before step 0)"
        if snapshot_step < 0
        else f"the snapshot of step {snapshot_step}"
    )
    knobs = ["TITAN_REWIND_MAX_REWINDS"]
    if skip_problems:
        skip = (
            " The escalation could not drop the batches it meant to "
            f"({skip_problems[-1]}), so TITAN_REWIND_ESCALATE_SKIP had no effect with this data "
            "iterator; "
        )
    else:
        knobs.append("TITAN_REWIND_ESCALATE_SKIP")
        skip = " "
    message = (
        f"rewind: {trigger.describe()} at step {index} is fault number {level} within "
        f"{window} steps of each other (steps "
        f"{', '.join(map(str, steps))}), after {level - 1} rewind(s) to {target}: the "
        f"divergence persists.{skip}Inspect the data after that step, lower the learning "
        f"rate, or raise {' / '.join(knobs)}."
    )
    return "\n".join([*recent, message]), knobs


def short_drops(outcomes: Sequence[tuple[int, int, int, str | None]]) -> str | None:
    """From every rank's ``(iterators, dropped, wanted, problem)``: the ranks that dropped
    fewer batches than the escalation wanted, and why, or None."""
    short = [
        (rank, problem or f"dropped {dropped} of {wanted}")
        for rank, (iterators, dropped, wanted, problem) in enumerate(outcomes)
        if problem or (iterators and dropped < wanted)
    ]
    if not short:
        return None
    groups: dict[str, list[int]] = {}
    for rank, text in short:
        groups.setdefault(text, []).append(rank)
    return "; ".join(f"rank(s) {rank_ranges(r)}: {text}" for text, r in groups.items())


def rolled_back(
    step: int,
    trigger: Trigger,
    target: str,
    seconds: float,
    steps_skipped: int,
    microbatches_skipped: int,
    level: int,
    dropped: int,
    wanted: int,
    skip_problem: str | None,
) -> str:
    """The log line of one rollback."""
    extra = ""
    if level > 1:
        extra = f", and dropped {dropped} more microbatches (escalation level {level})"
        if skip_problem:
            extra = (
                f"; escalation level {level} meant to drop {wanted} more microbatches per "
                f"data iterator but could not: {skip_problem}"
            )
    return (
        f"rewind: step {step}: {trigger.describe()}; restored {target} in "
        f"{seconds * 1e3:.1f} ms; the {steps_skipped} step(s) since it "
        f"({microbatches_skipped} microbatches) are skipped{extra}; the learning-rate "
        "schedule continues"
    )
