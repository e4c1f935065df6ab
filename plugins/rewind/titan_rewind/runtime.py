"""The rewind state machine of one process: check every step, snapshot, roll back, escalate.

Order inside one training iteration (all on the core's hooks, no patch of our own):

1. ``titan_train_step`` returns the schedule's per-microbatch loss reports (last pipeline stage)
   and we keep this rank's (numerator, denominator).
2. ``titan_optimizer_step``: before the update, wait for snapshot copies still in flight; after
   it, one all-reduce turns the loss, grad norm and flags into the same numbers on every rank,
   the detectors judge them, and every rank either counts a healthy step (maybe snapshotting)
   or restores the last stable snapshot. The decision follows the update: with bf16 and no
   loss scaler a NaN gradient has already been applied, and the restore overwrites it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from titan_rewind import collective, escalation, inject, loop, messages, reporting
from titan_rewind.config import RewindConfig
from titan_rewind.detect import Signals, Trigger
from titan_rewind.errors import RewindError
from titan_rewind.escalation import RewindEvent
from titan_rewind.recent import RecentSteps

if TYPE_CHECKING:
    from titan_rewind.store import SnapshotStore

log = logging.getLogger("titan_plugins.rewind")


def _rank() -> int:
    return collective.world()[0]


class Rewinder:
    """Per-process state: detectors, snapshot store, rewind history."""

    def __init__(self, config: RewindConfig) -> None:
        self.config = config
        self.detector = config.detector()
        self._store: SnapshotStore | None = None  # built at the first step (imports torch)
        self.events: list[RewindEvent] = []
        self.unhandled: list[dict[str, Any]] = []  # triggers with nothing to roll back to
        self.steps_checked = 0
        self.steps_skipped_by_scaler = 0
        self.last_signals: Signals | None = None
        self.recent = RecentSteps()  # what a message stopping the run leads with
        # This rank's (loss numerator, denominator) summed over the training calls since the
        # last optimizer step (several with gradient accumulation, or a megatron re-run).
        self._loss: tuple[float, float] | None = None
        self.microbatches_read = 0  # by this process's training calls since activation
        self._warned: set[str] = set()
        self._megatron_checked = False
        self._optimizer_checked = False
        # The starting state: buffers and RNG before the first forward, the rest before the
        # first update.
        self._early: Any = None
        self._early_mark = 0
        self._train_seen = False
        self._start_done = False
        self._no_model = False
        self._ranks_without_target = 0  # as last reported by the all-reduce

    @property
    def store_if_built(self) -> SnapshotStore | None:
        """The snapshot slots, or None before the first step built them."""
        return self._store

    @property
    def store(self) -> SnapshotStore:
        """The snapshot slots (created on first use)."""
        if self._store is None:
            from titan_rewind.store import SnapshotStore

            cfg = self.config
            self._store = SnapshotStore(cfg.interval, cfg.stable_after, cfg.max_host_bytes)
        return self._store

    # ------------------------------------------------------------------ hooks
    def before_train_step(self, step: Any) -> None:
        """Before the first training call runs: take the starting state's buffers and RNG
        states (the forward-backward changes both)."""
        if self._train_seen:
            return
        self._train_seen = True
        self._early_mark = self.microbatches_read
        chunks = [c for c in step.model if c is not None]
        if chunks and not self._start_done:
            from titan_rewind.snapshot import capture_early

            self._early = capture_early(chunks)

    def after_train_step(self, step: Any, result: Any) -> None:
        """Add this rank's loss of a training call (reports exist on the last stage only)."""
        self.microbatches_read += step.num_microbatches
        if not self._megatron_checked:
            self._megatron_checked = True
            self._check_megatron(step.model)
        if result:
            numerator, denominator = collective.local_loss(result, self.config.loss_key)
            if self._loss is not None:
                numerator, denominator = (
                    numerator + self._loss[0],
                    denominator + self._loss[1],
                )
            self._loss = (numerator, denominator)

    def before_optimizer_step(self, opt_step: Any = None) -> None:
        """Snapshot copies in flight must finish before the update writes the tensors; before
        the first update, take the starting state."""
        self.store.fence()
        if not self._start_done and opt_step is not None:
            self._start_done = True
            self._take_start(opt_step)

    def _take_start(self, opt_step: Any) -> None:
        optimizer = opt_step.optimizer
        chunks = self._chunks(opt_step)
        early, self._early = self._early, None
        self._optimizer_checked = True
        store = self.store
        store.no_snapshot = store.no_snapshot or loop.unsupported(optimizer)
        if not chunks:
            self._no_model = True
            return
        mark = self._early_mark if early is not None else self.microbatches_read
        # A refusal leaves nothing to roll back to: the job-wide notice after this optimizer
        # step says so once for every rank (``_notice_targets``), not each rank.
        store.capture_start(chunks, optimizer, early, mark)

    @staticmethod
    def _chunks(opt_step: Any) -> list[Any]:
        train = opt_step.step
        if train is not None:
            return [c for c in train.model if c is not None]
        return list(getattr(opt_step.optimizer, "model_chunks", None) or [])

    def after_optimizer_step(self, opt_step: Any, result: Any) -> None:
        """Judge the step (collectively) and snapshot or roll back."""
        train = opt_step.step
        index = train.index if train is not None else self.steps_checked
        loss, self._loss = self._loss, None
        update_successful, grad_norm = loop.unpack(result)
        can_roll_back = self.store.rollback_target() is not None
        signals = collective.reduce_signals(
            collective.local_vector(loss, grad_norm, update_successful, can_roll_back)
        )
        self.steps_checked += 1
        self.last_signals = signals
        if signals.skipped:  # the fp16 loss scaler skipped the update: its business, not ours
            self.steps_skipped_by_scaler += 1
            self.recent.record(index, signals, None)
            return
        chunks = self._chunks(opt_step)
        trigger = self.detector.check(signals)
        self.recent.record(index, signals, trigger)
        if trigger is not None:
            self._rewind(trigger, index, train, chunks, opt_step.optimizer, signals)
            return
        if signals.nonfinite_loss or signals.nonfinite_grad:
            return  # the nonfinite check is off: not healthy, not acted on
        self.detector.accept(signals)
        self._notice_targets(index, signals, can_roll_back)
        if not self._optimizer_checked:
            self._optimizer_checked = True
            self.store.no_snapshot = loop.unsupported(opt_step.optimizer)
        if not chunks:
            self._no_model = True
            self._warn_once("no_model", "rewind: no model chunks known; no snapshot is taken")
            return
        self.store.on_healthy_step(index, chunks, opt_step.optimizer, self.microbatches_read)
        if self.store.no_snapshot and self.store.rollback_target() is not None:
            # Later snapshots refused (the optimizer state grew): the held one stays the target.
            self._warn_once("no_snapshot", self.store.no_snapshot)

    # ------------------------------------------------------------------ nothing to roll back to
    def _why_no_target(self) -> tuple[str, tuple[str, ...]]:
        """Why this rank holds nothing to roll back to, and the knobs that would lift it."""
        return messages.no_target_reason(self.store, self._no_model, self.config.stable_after)

    def _gather_reasons(self, can_roll_back: bool) -> tuple[list[str], list[int], list[str]]:
        """Every rank's reason (a collective: every rank calls it in the same step)."""
        mine = None if can_roll_back else self._why_no_target()
        return messages.grouped(collective.gather(mine))

    def _notice_targets(self, index: int, signals: Signals, can_roll_back: bool) -> None:
        """When the number of ranks that hold nothing to roll back to changes to a non-zero
        count, rank 0 says so once for the job (the reasons are gathered: collective)."""
        count = signals.cannot_roll_back
        if count == self._ranks_without_target:
            return
        self._ranks_without_target = count
        if not count:
            return
        lines, _, _ = self._gather_reasons(can_roll_back)
        size = collective.world()[1]
        if _rank() == 0:
            log.warning("%s", messages.targets_missing(index, count, size, lines))

    def _cannot_roll_back(self, trigger: Trigger, index: int, signals: Signals) -> None:
        """Some rank holds nothing to roll back to: every rank learns why (collective); a
        non-finite step then raises ``RewindError`` on every rank (the full message on rank 0,
        one line elsewhere), a spike is reported once and training continues."""
        can = self.store.rollback_target() is not None
        lines, ranks, knobs = self._gather_reasons(can)
        size = collective.world()[1]
        head, helped = messages.cannot_roll_back(trigger, index, lines, ranks, size, knobs)
        if not trigger.kind.startswith("nonfinite"):
            self.unhandled.append({"step": index, "trigger": trigger.kind, "value": trigger.value})
            self._warn_once(
                f"unhandled{index}",
                "\n".join([head + "; training continues:", *lines, helped]),
            )
            return
        reason = lines[0].split(": ", 1)[1] if lines else "nothing to roll back to"
        if _rank() == 0:
            message = "\n".join(
                [
                    *self.recent.lines(),
                    head + "; the weights may hold NaN/Inf, so the run stops:",
                    *lines,
                    helped,
                ]
            )
            primary = True
        else:
            message = messages.stop_elsewhere(
                index,
                trigger.kind,
                "nothing to roll back to",
                "why, and the knobs that would have helped",
            )
            primary = False
        raise RewindError(message, step=index, reason=reason, knobs=knobs, primary=primary)

    # ------------------------------------------------------------------ rollback
    def _rewind(
        self,
        trigger: Trigger,
        index: int,
        train: Any,
        chunks: list[Any],
        optimizer: Any,
        signals: Signals,
    ) -> None:
        level = escalation.level(self.events, index, self.config.escalate_window)
        if level > self.config.max_rewinds:
            escalation.give_up(
                trigger,
                index,
                level,
                self.events,
                self.config.escalate_window,
                self.recent.lines(),
            )
        if signals.cannot_roll_back:
            self._cannot_roll_back(trigger, index, signals)
            return
        loop.assert_between_steps()
        started = time.perf_counter()
        slot = self.store.restore(chunks, optimizer)
        seconds = time.perf_counter() - started
        dropped, wanted, problem = 0, 0, None
        if level > 1 and self.config.escalate_skip:
            steps = (level - 1) * self.config.escalate_skip
            dropped, wanted, problem = escalation.drop(train, steps)
        event = RewindEvent(
            step=index,
            trigger=trigger.kind,
            value=trigger.value,
            threshold=trigger.threshold,
            snapshot_step=slot.step,
            steps_skipped=index - slot.step,
            microbatches_skipped=self.microbatches_read - slot.mark,
            extra_microbatches_dropped=dropped,
            level=level,
            seconds=seconds,
            extra_microbatches_wanted=wanted,
            skip_problem=problem,
        )
        self.events.append(event)
        escalation.log_rollback(event, trigger, slot.label())

    # ------------------------------------------------------------------ megatron's own checks
    def _check_megatron(self, chunks: list[Any]) -> None:
        """Say once when megatron's NaN checks will stop the run before rewind can act."""
        on = [
            name
            for chunk in chunks
            for name in ("check_for_nan_in_grad",)
            if getattr(getattr(chunk, "ddp_config", None), name, False)
        ]
        if on and "nonfinite" in self.config.detect:
            self._warn_once(
                "megatron_nan",
                "rewind: megatron's DDP check_for_nan_in_grad is on: a NaN gradient stops the "
                "run (rerun state machine exit, or RuntimeError) before rewind can roll back. "
                "With Megatron-LM pass --no-check-for-nan-in-loss-and-grad to let rewind handle "
                "NaN/Inf (see the rewind README).",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            (log.warning if _rank() == 0 else log.debug)(message)

    # ------------------------------------------------------------------ reporting
    def effects(self) -> dict[str, int | float]:
        """Flat numbers of what happened in this process (``titan_effects``; empty before the
        first step)."""
        return reporting.effects(self)

    def effect(self) -> dict[str, Any]:
        """This rank's numbers for the demo's after-training table and ``titan_report``."""
        return reporting.effect(self)


_CURRENT: list[Rewinder] = []
_STARTED_FOR = [0]  # the activation generation the current state machine belongs to


def start(config: RewindConfig) -> Rewinder:
    """A fresh state machine for a new activation (injections re-armed from the knob)."""
    _CURRENT[:] = [Rewinder(config)]
    inject.arm_from(config.inject_nan_steps)  # step indices restart from 0 with each activation
    return _CURRENT[0]


def current() -> Rewinder | None:
    """The state machine of the latest activation, if any; the first call after an activation
    starts it (so nothing of it is imported or built while megatron imports)."""
    from titan_rewind import generation

    if generation.current() != _STARTED_FOR[0]:
        _STARTED_FOR[0] = generation.current()
        start(RewindConfig.from_env())
    return _CURRENT[0] if _CURRENT else None


def effect() -> dict[str, Any]:
    """This rank's rewind numbers for an after-training table: ``active``, ``steps_checked``,
    ``rewinds`` and ``events`` (step, trigger, value, threshold, snapshot_step, steps_skipped,
    microbatches_skipped, level, seconds), ``snapshots`` held (step, stable, age),
    ``snapshots_taken``, ``host_bytes``, ``bytes_per_snapshot``, ``host_budget``."""
    rewinder = current()
    if rewinder is None:
        return {"active": False}
    return {"active": True, **rewinder.effect()}
