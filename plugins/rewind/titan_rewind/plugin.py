"""Hook implementations of ``rewind`` (entry point ``titan_plugins: rewind``).

No patch of its own: the core's training-loop hooks give the loss (``titan_train_step``), the
grad norm and the moment between iterations (``titan_optimizer_step``), and the microbatch
forward for the test-only fault injection (``titan_forward_microbatch``). Never imports megatron
at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_rewind import generation
from titan_rewind.settings import SETTINGS


def _current() -> Any:
    """This activation's state machine (started, and its modules imported, on first use)."""
    from titan_rewind import runtime

    return runtime.current()


@hookimpl
def titan_register_patches(register: Callable[[Any], None]) -> None:
    """Nothing to patch; a new activation: the first training-loop hook starts a fresh state
    machine (the core checks the knobs at activation)."""
    generation.bump()


@hookimpl
def titan_settings() -> list:
    """The ``TITAN_REWIND_*`` knobs."""
    return list(SETTINGS)


@hookimpl(wrapper=True)
def titan_train_step(step: Any) -> Any:
    """Before the first training call, take the starting state's buffers and RNG states; keep
    this rank's loss of each training call (last pipeline stage)."""
    rewinder = _current()
    if rewinder is not None and not step.forward_only:
        rewinder.before_train_step(step)
    result = yield
    rewinder = _current()
    if rewinder is not None and not step.forward_only:
        rewinder.after_train_step(step, result)
    return result


@hookimpl(wrapper=True)
def titan_optimizer_step(step: Any) -> Any:
    """Fence snapshot copies before the update (and take the starting state before the first
    one); judge the step and snapshot or roll back after it (every rank decides the same)."""
    rewinder = _current()
    if rewinder is not None:
        rewinder.before_optimizer_step(step)
    result = yield
    if rewinder is not None:
        rewinder.after_optimizer_step(step, result)
    return result


@hookimpl(wrapper=True)
def titan_forward_microbatch(call: Any) -> Any:
    """TEST ONLY: NaN injection (``TITAN_REWIND_INJECT_NAN_STEP`` / ``inject.nan_at_step``)."""
    from titan_rewind import inject

    _current()  # a new activation arms its injections when its state machine starts
    if call.step is not None and inject.armed():
        forward_step_func = call.arg("forward_step_func", 0)
        poisoned = inject.poison_forward(call.step.index, forward_step_func)
        if poisoned is not forward_step_func:
            if "forward_step_func" in call.kwargs:
                call.kwargs["forward_step_func"] = poisoned
            else:
                call.args = (poisoned, *call.args[1:])
    return (yield)


@hookimpl
def titan_report() -> dict[str, Any]:
    """Snapshots held, bytes, age, rewinds so far (see ``titan_rewind.effect``)."""
    try:
        rewinder = _current()
        if rewinder is None:
            return {"active": False}
        return {"active": True, **rewinder.effect()}
    except Exception as err:  # a report never breaks the caller
        return {"active": False, "error": f"{type(err).__name__}: {err}"}


@hookimpl
def titan_effects() -> dict[str, Any]:
    """Rewinds, snapshots, host bytes, batches skipped in this process (flat numbers)."""
    rewinder = _current()
    return rewinder.effects() if rewinder is not None else {}


@hookimpl
def titan_doctor() -> list:
    """Host budget against this machine's memory (and, once training ran, the model size)."""
    from titan_rewind.doctor import checks

    return checks()
