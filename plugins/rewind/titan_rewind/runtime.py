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
import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from titan_rewind import collective, inject, loop
from titan_rewind.config import RewindConfig
from titan_rewind.detect import Signals, Trigger
from titan_rewind.errors import RewindError

if TYPE_CHECKING:
    from titan_rewind.store import SnapshotStore

log = logging.getLogger("titan_plugins.rewind")


@dataclass
class RewindEvent:
    """One rollback, as logged and reported."""

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


def _rank() -> int:
    import torch

    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
        # This rank's (loss numerator, denominator) summed over the training calls since the
        # last optimizer step (several with gradient accumulation, or a megatron re-run).
        self._loss: tuple[float, float] | None = None
        self.microbatches_read = 0  # by this process's training calls since activation
        self._warned: set[str] = set()
        self._megatron_checked = False
        self._optimizer_checked = False

    @property
    def store(self) -> SnapshotStore:
        """The snapshot slots (created on first use)."""
        if self._store is None:
            from titan_rewind.store import SnapshotStore

            cfg = self.config
            self._store = SnapshotStore(cfg.interval, cfg.stable_after, cfg.max_host_bytes)
        return self._store

    # ------------------------------------------------------------------ hooks
    def after_train_step(self, step: Any, result: Any) -> None:
        """Add this rank's loss of a training call (reports exist on the last stage only)."""
        self.microbatches_read += step.num_microbatches
        if not self._megatron_checked:
            self._megatron_checked = True
            self._check_megatron(step.model)
        if result:
            numerator, denominator = collective.local_loss(result, self.config.loss_key)
            if self._loss is not None:
                numerator, denominator = numerator + self._loss[0], denominator + self._loss[1]
            self._loss = (numerator, denominator)

    def before_optimizer_step(self) -> None:
        """Snapshot copies in flight must finish before the update writes the tensors."""
        self.store.fence()

    def after_optimizer_step(self, opt_step: Any, result: Any) -> None:
        """Judge the step (collectively) and snapshot or roll back."""
        train = opt_step.step
        index = train.index if train is not None else self.steps_checked
        loss, self._loss = self._loss, None
        update_successful, grad_norm = loop.unpack(result)
        signals = collective.reduce_signals(
            collective.local_vector(loss, grad_norm, update_successful)
        )
        self.steps_checked += 1
        self.last_signals = signals
        if signals.skipped:  # the fp16 loss scaler skipped the update: its business, not ours
            self.steps_skipped_by_scaler += 1
            return
        chunks = (
            train.model if train is not None else getattr(opt_step.optimizer, "model_chunks", [])
        )
        trigger = self.detector.check(signals)
        if trigger is not None:
            self._rewind(trigger, index, train, chunks, opt_step.optimizer)
            return
        if signals.nonfinite_loss or signals.nonfinite_grad:
            return  # the nonfinite check is off: not healthy, not acted on
        self.detector.accept(signals)
        if not self._optimizer_checked:
            self._optimizer_checked = True
            self.store.no_snapshot = loop.unsupported(opt_step.optimizer)
        if not chunks:
            self._warn_once("no_model", "rewind: no model chunks known; no snapshot is taken")
            return
        self.store.on_healthy_step(index, chunks, opt_step.optimizer, self.microbatches_read)
        if self.store.no_snapshot:
            self._warn_once("no_snapshot", self.store.no_snapshot)

    # ------------------------------------------------------------------ rollback
    def _rewind(
        self, trigger: Trigger, index: int, train: Any, chunks: list[Any], optimizer: Any
    ) -> None:
        previous = self.events[-1] if self.events else None
        in_chain = previous is not None and index - previous.step <= self.config.escalate_window
        level = previous.level + 1 if in_chain else 1
        if level > self.config.max_rewinds:
            chain = [e.step for e in self._chain()] + [index]
            raise RewindError(
                f"rewind: {trigger.describe()} at step {index} is fault number {level} within "
                f"{self.config.escalate_window} steps of each other (steps "
                f"{', '.join(map(str, chain))}), after {level - 1} rewind(s) to the snapshot of "
                f"step {previous.snapshot_step}: the divergence persists. Inspect the data "
                "after that step, lower the learning rate, or raise TITAN_REWIND_MAX_REWINDS / "
                "TITAN_REWIND_ESCALATE_SKIP."
            )
        target = self.store.rollback_target()
        if target is None:
            why = self.store.no_snapshot or (
                f"no snapshot has had {self.config.stable_after} healthy steps after it yet"
            )
            message = (
                f"rewind: {trigger.describe()} at step {index}, but nothing to roll back to: {why}"
            )
            if trigger.kind.startswith("nonfinite"):
                raise RewindError(message + "; the weights may hold NaN/Inf, stopping.")
            self.unhandled.append({"step": index, "trigger": trigger.kind, "value": trigger.value})
            self._warn_once(f"unhandled{index}", message + "; training continues.")
            return
        loop.assert_between_steps()
        started = time.perf_counter()
        snapshot_step = target.step
        slot = self.store.restore(chunks, optimizer)
        dropped = 0
        if level > 1 and self.config.escalate_skip:
            dropped = loop.drop_batches(train, (level - 1) * self.config.escalate_skip)
        event = RewindEvent(
            step=index,
            trigger=trigger.kind,
            value=trigger.value,
            threshold=trigger.threshold,
            snapshot_step=slot.step,
            steps_skipped=index - snapshot_step,
            microbatches_skipped=self.microbatches_read - slot.mark,
            extra_microbatches_dropped=dropped,
            level=level,
            seconds=time.perf_counter() - started,
        )
        self.events.append(event)
        self._log_event(event, trigger)

    def _chain(self) -> list[RewindEvent]:
        """The latest run of rewinds each within the escalation window of the one before."""
        chain: list[RewindEvent] = []
        for event in reversed(self.events):
            if chain and chain[0].step - event.step > self.config.escalate_window:
                break
            chain.insert(0, event)
        return chain

    def _log_event(self, event: RewindEvent, trigger: Trigger) -> None:
        extra = (
            f", and dropped {event.extra_microbatches_dropped} more microbatches (escalation "
            f"level {event.level})"
            if event.level > 1
            else ""
        )
        message = (
            f"rewind: step {event.step}: {trigger.describe()}; restored the snapshot of step "
            f"{event.snapshot_step} in {event.seconds * 1e3:.1f} ms; the {event.steps_skipped} "
            f"step(s) since it ({event.microbatches_skipped} microbatches) are skipped{extra}; "
            "the learning-rate schedule continues"
        )
        (log.warning if _rank() == 0 else log.debug)(message)

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
        if not self.steps_checked:
            return {}
        store = self._store
        out: dict[str, int | float] = {
            "steps_checked": self.steps_checked,
            "rewinds": len(self.events),
            "snapshots_taken": store.taken if store is not None else 0,
            "snapshots_held": len(store.held()) if store is not None else 0,
            "host_bytes": store.host_bytes() if store is not None else 0,
            "microbatches_skipped": sum(e.microbatches_skipped for e in self.events),
            "extra_microbatches_dropped": sum(e.extra_microbatches_dropped for e in self.events),
            "restore_ms": round(sum(e.seconds for e in self.events) * 1e3, 3),
        }
        if self.events:
            out["last_rewind_step"] = self.events[-1].step
            out["last_restored_step"] = self.events[-1].snapshot_step
        return out

    def effect(self) -> dict[str, Any]:
        """This rank's numbers for the demo's after-training table and ``titan_report``."""
        store = self._store
        stable = store.rollback_target() if store is not None else None
        held = store.describe() if store is not None else loop.no_store(self.config)
        return {
            "steps_checked": self.steps_checked,
            "rewinds": len(self.events),
            "events": [_jsonable(asdict(e)) for e in self.events],
            "unhandled_triggers": list(self.unhandled),
            "skipped_by_loss_scaler": self.steps_skipped_by_scaler,
            "stable_snapshot_step": None if stable is None else stable.step,
            "thresholds": self.detector.thresholds(),
            "injected_nan_steps": sorted(inject.fired()),
            **held,
        }


_CURRENT: list[Rewinder] = []
_STARTED_FOR = [0]  # the activation generation the current state machine belongs to


def _jsonable(event: dict[str, Any]) -> dict[str, Any]:
    """NaN / Inf values as text (``"nan"``), so reports stay strict JSON."""
    return {
        k: repr(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in event.items()
    }


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
