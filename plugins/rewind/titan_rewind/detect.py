"""Detectors: non-finite values, loss spikes (robust z-score) and grad-norm spikes (factor over
a rolling median, on logarithms). Both spike rules judge a step against a rolling window of the
last healthy steps, so they follow the run's own trend. Pure Python on the step's global values,
so every rank, fed the same all-reduced numbers, takes the same decision.

Only healthy steps feed the references: a spike never raises its own bar.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x this = its standard deviation


@dataclass(frozen=True)
class Signals:
    """One step's global values, identical on every rank (see ``collective.reduce_signals``).

    :param loss: per-token loss over the data-parallel (and context-parallel) ranks of the last
        pipeline stage, or None when no rank reported one.
    :param grad_norm: the optimizer's global grad norm, or None when it was not computed.
    :param nonfinite_loss: some rank's loss was NaN/Inf.
    :param nonfinite_grad: some rank's grad norm was NaN/Inf.
    :param skipped: some rank's optimizer skipped the update (fp16 loss scaler found inf).
    :param cannot_roll_back: ranks that hold nothing to roll back to (0: every rank can).
    """

    loss: float | None
    grad_norm: float | None
    nonfinite_loss: bool = False
    nonfinite_grad: bool = False
    skipped: bool = False
    cannot_roll_back: int = 0


@dataclass(frozen=True)
class Trigger:
    """Why a step is bad: ``kind`` (nonfinite_loss / nonfinite_grad / loss_spike /
    grad_norm_spike), the value seen and the threshold it crossed (None for non-finite)."""

    kind: str
    value: float
    threshold: float | None = None

    def describe(self) -> str:
        """``loss_spike 14.2 > 5.31`` / ``nonfinite_loss nan``."""
        if self.threshold is None:
            return f"{self.kind} {self.value}"
        return f"{self.kind} {self.value:.6g} > {self.threshold:.6g}"


def _median_and_mad(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and their median absolute deviation from it."""
    median = statistics.median(values)
    return median, statistics.median(abs(x - median) for x in values)


class LossSpike:
    """Loss above ``median + zscore x max(1.4826 x MAD, min_spread x median)`` of the last
    ``window`` healthy losses; silent until ``min_history`` losses were seen. One-sided: a
    falling loss never triggers. The window rolls, so the bar follows the run's own trend."""

    def __init__(self, window: int, min_history: int, zscore: float, min_spread: float) -> None:
        self.history: deque[float] = deque(maxlen=window)
        self.min_history = min_history
        self.zscore = zscore
        self.min_spread = min_spread

    def threshold(self) -> float | None:
        """The current bar, or None during warm-up."""
        if len(self.history) < max(self.min_history, 1):
            return None
        median, mad = _median_and_mad(self.history)
        spread = max(MAD_TO_SIGMA * mad, self.min_spread * abs(median))
        return median + self.zscore * spread

    def check(self, loss: float) -> Trigger | None:
        """A trigger when ``loss`` crosses the bar."""
        bar = self.threshold()
        if bar is not None and loss > bar:
            return Trigger("loss_spike", loss, bar)
        return None

    def accept(self, loss: float) -> None:
        """Add a healthy step's loss to the reference."""
        self.history.append(loss)


class GradNormSpike:
    """Grad norm above ``median x max(factor, exp(zscore x 1.4826 x MAD))`` of the last
    ``window`` healthy grad norms, median and MAD taken on their logarithms; silent until
    ``min_history`` norms were seen.

    Why on logarithms: a grad norm moves by factors (it falls tenfold while a model fits, and
    jumps several-fold for one step when the loss is near its floor), so "how many times the
    recent median" is the scale-free question. The median of a rolling window follows a slow
    drift up or down (a run is never judged against its early-training scale), one outlier
    does not move it, and the MAD widens the bar while the norms themselves are still moving
    fast (early training), where a fixed factor would be too tight.
    """

    def __init__(self, window: int, min_history: int, factor: float, zscore: float) -> None:
        self.history: deque[float] = deque(maxlen=window)
        self.min_history = min_history
        self.factor = factor
        self.zscore = zscore

    def threshold(self) -> float | None:
        """The current bar, or None during warm-up."""
        if len(self.history) < max(self.min_history, 1):
            return None
        median, mad = _median_and_mad(self.history)
        return math.exp(median + max(math.log(self.factor), self.zscore * MAD_TO_SIGMA * mad))

    def check(self, grad_norm: float) -> Trigger | None:
        """A trigger when ``grad_norm`` crosses the bar."""
        bar = self.threshold()
        if bar is not None and grad_norm > bar:
            return Trigger("grad_norm_spike", grad_norm, bar)
        return None

    def accept(self, grad_norm: float) -> None:
        """Add a healthy step's grad norm to the reference (a zero norm, e.g. a frozen model,
        counts as the smallest positive float: its logarithm must exist)."""
        self.history.append(math.log(max(grad_norm, sys.float_info.min)))


class Detector:
    """All enabled checks, in order: non-finite, loss spike, grad-norm spike.

    :param enabled: a subset of ``("nonfinite", "loss", "grad_norm")``.
    """

    def __init__(self, enabled: tuple[str, ...], loss: LossSpike, grad: GradNormSpike) -> None:
        self.enabled = frozenset(enabled)
        self.loss = loss
        self.grad = grad

    def check(self, signals: Signals) -> Trigger | None:
        """The first trigger this step fires, or None for a healthy step."""
        if "nonfinite" in self.enabled:
            # The value is NaN or Inf on some rank; the reduced numbers exclude it.
            if signals.nonfinite_loss:
                return Trigger("nonfinite_loss", math.nan)
            if signals.nonfinite_grad:
                return Trigger("nonfinite_grad", math.nan)
        if signals.nonfinite_loss or signals.nonfinite_grad:
            return None  # non-finite values are not judged by the spike checks
        if "loss" in self.enabled and signals.loss is not None:
            found = self.loss.check(signals.loss)
            if found is not None:
                return found
        if "grad_norm" in self.enabled and signals.grad_norm is not None:
            return self.grad.check(signals.grad_norm)
        return None

    def accept(self, signals: Signals) -> None:
        """Feed a healthy step into the references."""
        if signals.loss is not None and math.isfinite(signals.loss):
            self.loss.accept(signals.loss)
        if signals.grad_norm is not None and math.isfinite(signals.grad_norm):
            self.grad.accept(signals.grad_norm)

    def thresholds(self) -> dict[str, float | None]:
        """Current bars, for reports."""
        return {"loss": self.loss.threshold(), "grad_norm": self.grad.threshold()}
