"""Rewinds in a row: the escalation level of a new fault, the batches a higher level drops, and
the job-wide stop once the divergence outlasts ``TITAN_REWIND_MAX_REWINDS``.

A fault within ``escalate_window`` steps of the previous rewind belongs to the same chain and
raises its level; level L drops ``(L - 1) * escalate_skip`` steps of batches on every rank, so a
bad stretch of data is skipped rather than replayed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from titan_rewind import collective, loop, messages
from titan_rewind.errors import RewindError

if TYPE_CHECKING:
    from titan_rewind.detect import Trigger

log = logging.getLogger("titan_plugins.rewind")


@dataclass
class RewindEvent:
    """One rollback, as logged and reported (``snapshot_step`` -1: the starting state)."""

    step: int
    trigger: str
    value: float
    threshold: float | None
    snapshot_step: int
    steps_skipped: int
    microbatches_skipped: int
    extra_microbatches_dropped: int
    level: int
    seconds: float
    extra_microbatches_wanted: int = 0
    skip_problem: str | None = None  # why the escalation dropped fewer than wanted


def level(events: Sequence[RewindEvent], index: int, window: int) -> int:
    """The escalation level of a fault at step ``index``: one more than the previous rewind's
    when that one is within ``window`` steps, else 1."""
    previous = events[-1] if events else None
    if previous is not None and index - previous.step <= window:
        return previous.level + 1
    return 1


def chain(events: Sequence[RewindEvent], window: int) -> list[RewindEvent]:
    """The latest run of rewinds each within ``window`` steps of the one before."""
    run: list[RewindEvent] = []
    for event in reversed(events):
        if run and run[0].step - event.step > window:
            break
        run.insert(0, event)
    return run


def drop(train: Any, steps: int) -> tuple[int, int, str | None]:
    """Drop ``steps`` steps of microbatches on every rank; (dropped here, wanted, the job's
    problem or None). Every rank learns every rank's outcome (collective)."""
    skip = loop.drop_batches(train, steps)
    outcomes = collective.gather((skip.iterators, skip.dropped, skip.wanted, skip.problem))
    return skip.dropped, skip.wanted, messages.short_drops(outcomes)


def give_up(
    trigger: Trigger,
    index: int,
    fault: int,
    events: Sequence[RewindEvent],
    window: int,
    recent: Sequence[str] = (),
) -> NoReturn:
    """Fault number ``max_rewinds + 1`` in one chain: raise on every rank (the full message on
    rank 0, led by the ``recent`` steps' lines; one line elsewhere)."""
    run = chain(events, window)
    message, knobs = messages.give_up(
        trigger,
        index,
        fault,
        window,
        [e.step for e in run] + [index],
        run[-1].snapshot_step,
        [e.skip_problem for e in run if e.skip_problem],
        recent,
    )
    primary = collective.world()[0] == 0
    if not primary:
        message = messages.stop_elsewhere(
            index, trigger.kind, f"fault number {fault} in a row", "the steps, and the knobs"
        )
    raise RewindError(message, step=index, reason="repeated faults", knobs=knobs, primary=primary)


def log_rollback(event: RewindEvent, trigger: Trigger, target: str) -> None:
    """Say one rollback: on rank 0 as a warning, on the others at debug level."""
    message = messages.rolled_back(
        event.step,
        trigger,
        target,
        event.seconds,
        event.steps_skipped,
        event.microbatches_skipped,
        event.level,
        event.extra_microbatches_dropped,
        event.extra_microbatches_wanted,
        event.skip_problem,
    )
    (log.warning if collective.world()[0] == 0 else log.debug)(message)
