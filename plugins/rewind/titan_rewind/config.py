"""The resolved ``TITAN_REWIND_*`` knobs of one activation."""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_plugins.settings import complain
from titan_rewind import settings as s
from titan_rewind.detect import Detector, GradNormSpike, LossSpike


@dataclass(frozen=True)
class RewindConfig:
    """Every knob, typed (see ``settings.py`` for what each one does)."""

    interval: int = s.INTERVAL.default
    stable_after: int = s.STABLE_AFTER.default
    max_host_bytes: int | None = s.MAX_HOST_BYTES.default
    detect: tuple[str, ...] = s.DETECT.default
    loss_key: str = s.LOSS_KEY.default
    loss_window: int = s.LOSS_WINDOW.default
    loss_min_history: int = s.LOSS_MIN_HISTORY.default
    loss_zscore: float = s.LOSS_ZSCORE.default
    loss_min_spread: float = s.LOSS_MIN_SPREAD.default
    grad_window: int = s.GRAD_WINDOW.default
    grad_factor: float = s.GRAD_FACTOR.default
    grad_zscore: float = s.GRAD_ZSCORE.default
    grad_min_history: int = s.GRAD_MIN_HISTORY.default
    escalate_window: int = s.ESCALATE_WINDOW.default
    escalate_skip: int = s.ESCALATE_SKIP.default
    max_rewinds: int = s.MAX_REWINDS.default
    inject_nan_steps: tuple[str, ...] = s.INJECT_NAN_STEP.default

    @classmethod
    def from_env(cls) -> RewindConfig:
        """Read every knob (a bad value warns and falls back, or raises under STRICT)."""
        return cls._read()._warm_up_within_window()

    @classmethod
    def _read(cls) -> RewindConfig:
        return cls(
            interval=s.INTERVAL.read(),
            stable_after=s.STABLE_AFTER.read(),
            max_host_bytes=s.MAX_HOST_BYTES.read(),
            detect=s.DETECT.read(),
            loss_key=s.LOSS_KEY.read(),
            loss_window=s.LOSS_WINDOW.read(),
            loss_min_history=s.LOSS_MIN_HISTORY.read(),
            loss_zscore=s.LOSS_ZSCORE.read(),
            loss_min_spread=s.LOSS_MIN_SPREAD.read(),
            grad_window=s.GRAD_WINDOW.read(),
            grad_factor=s.GRAD_FACTOR.read(),
            grad_zscore=s.GRAD_ZSCORE.read(),
            grad_min_history=s.GRAD_MIN_HISTORY.read(),
            escalate_window=s.ESCALATE_WINDOW.read(),
            escalate_skip=s.ESCALATE_SKIP.read(),
            max_rewinds=s.MAX_REWINDS.read(),
            inject_nan_steps=s.INJECT_NAN_STEP.read(),
        )

    def _warm_up_within_window(self) -> RewindConfig:
        """A warm-up longer than its window would never end (the window holds fewer healthy
        steps than it waits for): say so and start the check once the window is full."""
        fixed = self
        for check, warm, window in (
            ("loss", s.LOSS_MIN_HISTORY, s.LOSS_WINDOW),
            ("grad", s.GRAD_MIN_HISTORY, s.GRAD_WINDOW),
        ):
            wanted, held = getattr(self, f"{check}_min_history"), getattr(self, f"{check}_window")
            if wanted > held:
                complain(
                    f"{warm.name}={wanted} is more than the {held} healthy steps "
                    f"{window.name} holds, so that check would never start: lower it or raise "
                    f"{window.name}",
                    f"the check starts once the window is full, after {held} steps",
                )
                fixed = replace(fixed, **{f"{check}_min_history": held})
        return fixed

    def detector(self) -> Detector:
        """Fresh detectors with these thresholds."""
        return Detector(
            self.detect,
            LossSpike(
                self.loss_window, self.loss_min_history, self.loss_zscore, self.loss_min_spread
            ),
            GradNormSpike(
                self.grad_window, self.grad_min_history, self.grad_factor, self.grad_zscore
            ),
        )
