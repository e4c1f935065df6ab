"""The last few steps' global losses and grad norms, kept so that a message stopping the run
can lead with them (the numbers a user wants first when the job ends: was the loss really
blowing up, or was it falling?)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_rewind.detect import Signals, Trigger

KEPT = 8  # steps shown: enough to see a trend and the faults of one escalation chain


@dataclass(frozen=True)
class StepRecord:
    """One judged step: its index, the global numbers and the trigger it fired (or None)."""

    index: int
    loss: float | None
    grad_norm: float | None
    nonfinite_loss: bool = False
    nonfinite_grad: bool = False
    skipped: bool = False
    trigger: str | None = None

    def line(self) -> str:
        """``  step 102: loss 0.0218, grad norm 1.425 (grad_norm_spike)``."""
        loss = "nan/inf" if self.nonfinite_loss else _number(self.loss)
        norm = "nan/inf" if self.nonfinite_grad else _number(self.grad_norm)
        note = ""
        if self.skipped:
            note = " (update skipped by the loss scaler)"
        elif self.trigger:
            note = f" ({self.trigger})"
        return f"  step {self.index}: loss {loss}, grad norm {norm}{note}"


def _number(value: float | None) -> str:
    # None: no rank reported a loss (or the optimizer computed no grad norm) at that step
    return "n/a" if value is None else f"{value:.6g}"


class RecentSteps:
    """The last ``KEPT`` judged steps (healthy, rolled back or skipped), in order."""

    def __init__(self, kept: int = KEPT) -> None:
        self.records: deque[StepRecord] = deque(maxlen=kept)

    def record(self, index: int, signals: Signals, trigger: Trigger | None) -> None:
        """Keep one step's global numbers and what the detectors said about it."""
        self.records.append(
            StepRecord(
                index,
                signals.loss,
                signals.grad_norm,
                signals.nonfinite_loss,
                signals.nonfinite_grad,
                signals.skipped,
                trigger.kind if trigger is not None else None,
            )
        )

    def lines(self) -> list[str]:
        """The heading and one line per kept step (empty when no step was judged yet)."""
        if not self.records:
            return []
        count = len(self.records)
        return [
            f"rewind: the last {count} step(s) before the stop (global loss, grad norm):",
            *(record.line() for record in self.records),
        ]
