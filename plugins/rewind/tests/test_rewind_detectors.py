"""rewind's spike detectors on long runs: healthy curves (two recorded from the CPU demo's model,
synthetic ones shaped like a real run) never trigger with the default knobs, real spikes do.

Pure Python on the detectors (no megatron, no torch): the 500-step demo is too slow for a test,
its curves are replayed from ``data/healthy_curves.json``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from titan_rewind.config import RewindConfig
from titan_rewind.detect import GradNormSpike, Signals

pytestmark = pytest.mark.line_independent

CURVES = json.loads((Path(__file__).parent / "data" / "healthy_curves.json").read_text())
PROBE_STEP, PROBE_NORM = 74, 1.42502  # issue 46's probe: the demo's healthy jump there


def recorded(name: str) -> tuple[list[float], list[float]]:
    """One recorded curve: (losses, grad norms); "probe" is the 4-process demo with the grad
    norm issue 46's probe saw at step 74 (a one-step jump of 25x while the loss fell)."""
    curve = CURVES["demo_pp2_ep2_200" if name == "probe" else name]
    norms = list(curve["grad_norm"])
    if name == "probe":
        norms[PROBE_STEP] = PROBE_NORM
    return list(curve["loss"]), norms


def falling_loss_rising_norm(steps: int, seed: int) -> tuple[list[float], list[float]]:
    """A pretraining-like run: the loss falls from 5 to about 1.6 with 2% noise, the grad norm
    rises slowly from 0.5 to 1.4 with 10% noise, and one step in 25 jumps 1.5-2x."""
    rng = random.Random(seed)
    losses, norms = [], []
    for i in range(steps):
        progress = i / (steps - 1)
        losses.append((1.5 + 3.5 * math.exp(-4 * progress)) * (1 + rng.gauss(0, 0.02)))
        norm = (0.5 + 0.9 * progress) * math.exp(rng.gauss(0, 0.1))
        if rng.random() < 0.04:
            norm *= rng.uniform(1.5, 2.0)
        norms.append(norm)
    return losses, norms


def fitting_run(steps: int, seed: int) -> tuple[list[float], list[float]]:
    """A model fitting its data: loss and grad norm fall a hundredfold, noisy, with one-step
    grad-norm jumps of 1.5-2x (one step in 20) and of 6x (one in 100), as the demo shows."""
    rng = random.Random(seed)
    losses, norms = [], []
    for i in range(steps):
        decay = math.exp(-4.6 * i / steps)
        losses.append(4.8 * decay * (1 + rng.gauss(0, 0.03)))
        norm = 2.0 * decay * math.exp(rng.gauss(0, 0.1))
        draw = rng.random()
        if draw < 0.01:
            norm *= 6.0
        elif draw < 0.06:
            norm *= rng.uniform(1.5, 2.0)
        norms.append(norm)
    return losses, norms


def replay(losses: list[float], norms: list[float], faults: dict | None = None) -> list:
    """Feed a run to the default detectors as the state machine does (only healthy steps feed
    the references); ``faults`` maps a step to (loss, grad norm) replacing its values. Returns
    [(step, trigger kind)] and the bars after the last step."""
    faults = faults or {}
    detector = RewindConfig().detector()
    fired = []
    for step, (loss, norm) in enumerate(zip(losses, norms)):
        loss, norm = faults.get(step, (loss, norm))
        bad = not (math.isfinite(loss) and math.isfinite(norm))
        signals = Signals(loss, norm, nonfinite_loss=not math.isfinite(loss))
        if bad:
            signals = Signals(None, norm, nonfinite_loss=True)
        trigger = detector.check(signals)
        if trigger is not None:
            fired.append((step, trigger.kind))
        else:
            detector.accept(signals)
    return fired, detector.thresholds()


HEALTHY = {
    "world1_500": lambda: recorded("world1_500"),
    "demo_pp2_ep2_200": lambda: recorded("demo_pp2_ep2_200"),
    "probe": lambda: recorded("probe"),
    "pretraining_600": lambda: falling_loss_rising_norm(600, seed=1),
    "pretraining_2000": lambda: falling_loss_rising_norm(2000, seed=2),
    "fitting_600": lambda: fitting_run(600, seed=3),
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_a_healthy_run_never_triggers_with_the_default_knobs(name):
    losses, norms = HEALTHY[name]()
    fired, bars = replay(losses, norms)
    assert fired == []
    assert bars["loss"] is not None and bars["grad_norm"] is not None  # armed, not warming up


def test_the_recorded_curves_are_the_demos():
    # What the no-trigger test above replays: 500 / 200 steps of a falling loss, with one-step
    # grad-norm jumps the old rule (8x an EMA) took for spikes: 8.5x at step 291, 25x at 74.
    losses, norms = recorded("world1_500")
    assert len(losses) == len(norms) == 500 and losses[-1] < losses[0] / 1000
    assert norms[291] / norms[290] > 8.5
    losses, norms = recorded("probe")
    assert len(norms) == 200 and norms[PROBE_STEP] / norms[PROBE_STEP - 1] > 25


def level(values: list[float], step: int) -> float:
    """The run's current value at ``step``: the median of the five steps before it."""
    return sorted(values[step - 5 : step])[2]


# (what, the faulty (loss, grad norm) from the run's current levels, the trigger)
SPIKES = [
    ("grad norm x30", lambda loss, norm: (loss, 30 * norm), "grad_norm_spike"),
    ("grad norm x12", lambda loss, norm: (loss, 12 * norm), "grad_norm_spike"),
    ("loss x3", lambda loss, norm: (3 * loss, norm), "loss_spike"),
    ("loss +60%", lambda loss, norm: (1.6 * loss, norm), "loss_spike"),
    ("nan loss", lambda loss, norm: (math.nan, norm), "nonfinite_loss"),
]
# Steps where the run has settled enough for its window to judge (the demo's first ~150 steps
# fall a hundredfold: there the rolling median lags and the grad-norm bar widens, on purpose).
SETTLED = {
    "world1_500": (250, 480),
    "demo_pp2_ep2_200": (160, 195),
    "pretraining_600": (60, 250, 480),
    "pretraining_2000": (100, 1000, 1900),
    "fitting_600": (250, 480),
}


# On a falling curve the rolling median lags above today's value (by about half the window), so
# there a spike must be larger to cross the bar: x12 / +60% are judged on the slowly drifting runs.
FALLING = {"world1_500", "demo_pp2_ep2_200", "fitting_600"}
SMALL = {"grad norm x12", "loss +60%"}


CASES = [
    pytest.param(name, what, make, kind, id=f"{what}-{name}")
    for name in sorted(SETTLED)
    for what, make, kind in SPIKES
    if not (name in FALLING and what in SMALL)
]


@pytest.mark.parametrize(("name", "what", "make", "kind"), CASES)
def test_a_real_spike_triggers_at_its_step(name, what, make, kind):
    losses, norms = HEALTHY[name]()
    for step in SETTLED[name]:
        fault = make(level(losses, step), level(norms, step))
        fired, _ = replay(losses, norms, {step: fault})
        assert fired == [(step, kind)], (what, step)


def test_a_tenfold_grad_norm_on_a_rising_trend_triggers():
    # The rolling median lags a rising norm, so ten times today's norm is over ten times it.
    losses, norms = falling_loss_rising_norm(600, seed=1)
    trend = 0.5 + 0.9 * 400 / 599
    fired, _ = replay(losses, norms, {400: (losses[400], 10 * trend)})
    assert fired == [(400, "grad_norm_spike")]


def test_grad_norm_bar_is_factor_times_the_rolling_median_widened_by_the_log_mad():
    grad = GradNormSpike(window=5, min_history=3, factor=4.0, zscore=2.0)
    for value in (1.0, 1.0):
        grad.accept(value)
        assert grad.check(1e9) is None  # warm-up
    grad.accept(1.0)
    assert grad.threshold() == pytest.approx(4.0)  # MAD 0: the factor alone
    assert grad.check(3.99) is None and grad.check(4.01).kind == "grad_norm_spike"
    for value in (4.0, 0.25, 4.0, 0.25):  # the window is now 1, 4, 0.25, 4, 0.25
        grad.accept(value)
    # log median 0, MAD ln 4: bar exp(2 x 1.4826 x ln 4) = 4 ** 2.9652 > the factor 4
    assert grad.threshold() == pytest.approx(4.0 ** (2 * 1.4826))
    for value in (2.0,) * 5:  # the old values leave the window: the bar follows the trend
        grad.accept(value)
    assert grad.threshold() == pytest.approx(8.0)


def test_a_zero_grad_norm_is_accepted():
    grad = GradNormSpike(window=5, min_history=1, factor=10.0, zscore=3.0)
    grad.accept(0.0)  # a frozen model: its logarithm is taken of the smallest positive float
    assert 0.0 < grad.threshold() < 1e-300


@pytest.mark.parametrize(
    ("warm", "window", "field"),
    [
        ("TITAN_REWIND_LOSS_MIN_HISTORY", "TITAN_REWIND_LOSS_WINDOW", "loss_min_history"),
        ("TITAN_REWIND_GRAD_MIN_HISTORY", "TITAN_REWIND_GRAD_WINDOW", "grad_min_history"),
    ],
)
def test_a_warm_up_longer_than_its_window_is_named_and_ends_when_the_window_is_full(
    monkeypatch, caplog, warm, window, field
):
    from titan_plugins.settings import SettingError

    monkeypatch.setenv(warm, "60")
    monkeypatch.setenv(window, "40")
    message = (
        f"{warm}=60 is more than the 40 healthy steps {window} holds, so that check would "
        f"never start: lower it or raise {window}"
    )
    with caplog.at_level("WARNING", logger="titan_plugins"):
        config = RewindConfig.from_env()
    assert getattr(config, field) == 40
    assert f"{message} (the check starts once the window is full, after 40 steps)" in caplog.text
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=message):
        RewindConfig.from_env()
