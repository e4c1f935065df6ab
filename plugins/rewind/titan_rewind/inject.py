"""TEST ONLY: make one microbatch of chosen training steps produce a NaN loss.

For tests and the demo's ``--inject-fault STEP``: ``TITAN_REWIND_INJECT_NAN_STEP=12`` (read at
activation; a comma list for several steps) or :func:`nan_at_step` in the process. A step index
is the 0-based count of training calls of megatron's forward-backward schedule in this process
since the plugin was activated (``TrainStep.index``), the same numbers the rewind log uses.

The first microbatch whose loss function runs in that step (the last pipeline stage computes
losses) has its model output multiplied by NaN before the loss function sees it: the loss
report is NaN, and the backward sends NaN gradients to every stage, as a real numerical blow-up
would. Nothing else changes; each listed step fires once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

_MANUAL: set[int] = set()  # armed by nan_at_step: kept until clear()
_FROM_ENV: set[int] = set()  # armed by the knob: replaced at each activation
_FIRED: set[int] = set()


def nan_at_step(*steps: int) -> None:
    """Arm NaN injection at these step indices (adds to those already armed; kept across
    activations until :func:`clear`)."""
    for step in steps:
        if int(step) < 0:
            raise ValueError(f"nan_at_step: step {step} is negative; steps count from 0")
        _MANUAL.add(int(step))


def clear() -> None:
    """Disarm every injection and forget which fired."""
    _MANUAL.clear()
    _FROM_ENV.clear()
    _FIRED.clear()


def armed() -> frozenset[int]:
    """Steps still armed."""
    return frozenset((_MANUAL | _FROM_ENV) - _FIRED)


def fired() -> frozenset[int]:
    """Steps where a NaN was injected."""
    return frozenset(_FIRED)


def arm_from(values: Iterable[str]) -> None:
    """Arm exactly the steps of ``TITAN_REWIND_INJECT_NAN_STEP`` (validated as digits) for a
    new activation; every armed step may fire again (step indices restart from 0)."""
    _FROM_ENV.clear()
    _FIRED.clear()
    _FROM_ENV.update(int(v) for v in values)


def poison_forward(step: int, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
    """``forward_step_func`` whose loss function, the first time it runs in ``step``, sees a
    NaN model output. Returned unchanged when ``step`` is not armed."""
    if step not in armed():
        return forward_step_func

    def forward(*args: Any, **kwargs: Any) -> Any:
        output, loss_func = forward_step_func(*args, **kwargs)

        def poisoned_loss(output_tensor: Any, *rest: Any, **options: Any) -> Any:
            if step not in _FIRED and hasattr(output_tensor, "mul"):
                _FIRED.add(step)
                output_tensor = output_tensor.mul(math.nan)
            return loss_func(output_tensor, *rest, **options)

        return output, poisoned_loss

    return forward
