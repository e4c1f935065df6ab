"""The core's train-step hooks: one patch on each Megatron schedule / optimizer entry point.

Megatron has no callback around a training iteration, so several plugins used to wrap the same
``schedules.forward_backward_*`` functions, each with its own records. The core owns those
patches now and calls pluggy *wrapper* hooks (``titan_train_step``, ``titan_forward_microbatch``,
``titan_backward_microbatch``, ``titan_optimizer_step``). The core's own implementation is the
only non-wrapper one: it runs Megatron's original function and returns its result, which every
plugin wrapper receives from ``yield`` and returns (pluggy's ``wrapper=True`` style)::

    @hookimpl(wrapper=True)
    def titan_train_step(step):
        prepare(step)
        try:
            return (yield)
        finally:
            finish(step)

When no plugin wraps a hook, the patched function calls Megatron's original directly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
OPTIMIZER_CUDA_GRAPH = "megatron.core.optimizer.optimizer_cuda_graph"  # 0.17+
OPTIMIZER = "megatron.core.optimizer.optimizer"

# Schedule function -> the schedule's short name (TrainStep.schedule).
SCHEDULE_KINDS: dict[str, str] = {
    "forward_backward_no_pipelining": "no_pipelining",
    "forward_backward_pipelining_without_interleaving": "1f1b",
    "forward_backward_pipelining_with_interleaving": "interleaved",
}
# Optimizer classes whose ``step`` is the outermost one a training loop calls
# (DistributedOptimizer and Float16OptimizerWithFloat16Params inherit MixedPrecisionOptimizer's).
OPTIMIZER_CLASSES = ("MixedPrecisionOptimizer", "FP32Optimizer", "ChainedOptimizer")

# Hooks that only wrappers may implement (the core runs the original function).
WRAPPER_HOOKS = (
    "titan_train_step",
    "titan_forward_microbatch",
    "titan_backward_microbatch",
    "titan_optimizer_step",
)


class Call:
    """One call of a patched Megatron function, as the hooks see it.

    :param function: Megatron's original function (the core calls it with ``args``/``kwargs``).
    :param args: positional arguments of the call.
    :param kwargs: keyword arguments of the call.
    :param state: scratch space for wrappers, keyed by plugin name.
    :param result: what Megatron's function returned (set once the call has run).

    The subclasses take these first (positionally or by name) and their own fields by name.
    """

    # Plain classes, not dataclasses: this module loads inside every ``import megatron`` and
    # the four dataclasses cost ~3 ms there to generate their methods.
    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: dict[str, Any] | None = None,
        result: Any = None,
    ) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.state: dict[str, Any] = {} if state is None else state
        self.result = result

    def __repr__(self) -> str:
        # names only: the arguments are models, data iterators and tensors
        base = ("function", "args", "kwargs", "state", "result")
        extra = "".join(f", {k}={v!r}" for k, v in vars(self).items() if k not in base)
        name = getattr(self.function, "__name__", "?")
        return f"{type(self).__name__}({name}, kwargs={sorted(self.kwargs)}{extra})"

    def run(self) -> Any:
        """Call Megatron's original function (the core's own hook implementation does this)."""
        self.result = self.function(*self.args, **self.kwargs)
        return self.result

    def arg(self, name: str, position: int, default: Any = None) -> Any:
        """An argument by keyword or, when passed positionally, by its position."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[position] if len(self.args) > position else default


class TrainStep(Call):
    """One call of ``forward_backward_*``: the forward and backward of every microbatch of one
    iteration (or, with ``forward_only``, an evaluation pass).

    :param schedule: ``"no_pipelining"``, ``"1f1b"`` or ``"interleaved"``.
    :param index: training calls made before this one since the registry was activated in
        this process (0-based); an evaluation call carries the index of the next training call.
    """

    def __init__(self, *call: Any, schedule: str = "", index: int = 0, **fields: Any) -> None:
        super().__init__(*call, **fields)  # function, args, kwargs[, state, result]
        self.schedule = schedule
        self.index = index

    @property
    def forward_only(self) -> bool:
        """Whether this is an evaluation pass (no backward)."""
        return bool(self.kwargs.get("forward_only", False))

    @property
    def model(self) -> list[Any]:
        """The model chunks (always a list)."""
        model = self.kwargs.get("model")
        return list(model) if isinstance(model, list | tuple) else [model]

    @property
    def num_microbatches(self) -> int:
        """Microbatches in this call."""
        return int(self.kwargs.get("num_microbatches", 0))


class Microbatch(Call):
    """One ``schedules.forward_step`` or ``schedules.backward_step`` call inside a TrainStep.

    :param phase: ``"forward"`` or ``"backward"``.
    :param step: the TrainStep running it (None when called outside a patched schedule).
    """

    def __init__(
        self, *call: Any, phase: str = "forward", step: TrainStep | None = None, **fields: Any
    ) -> None:
        super().__init__(*call, **fields)  # function, args, kwargs[, state, result]
        self.phase = phase
        self.step = step

    @property
    def model(self) -> Any:
        """Forward: the model chunk being run."""
        return self.arg("model", 2)

    @property
    def input_tensor(self) -> Any:
        """Forward: the tensor received from the previous stage (None on the first).

        The 1F1B schedule passes a one-element list (one tensor shape per stage): unwrapped.
        """
        received = self.arg("input_tensor", 4)
        if isinstance(received, list | tuple) and len(received) == 1:
            return received[0]
        return received

    @property
    def vp_stage(self) -> int | None:
        """Forward: the virtual pipeline chunk (None without VPP)."""
        return self.kwargs.get("vp_stage")

    @property
    def output_tensor(self) -> Any:
        """Backward: the forward output whose gradient is being computed."""
        return self.arg("output_tensor", 1)


class OptimizerStep(Call):
    """One call of a Megatron optimizer's ``step`` (returns update_successful, grad_norm,
    num_zeros_in_grad).

    :param step: the last training TrainStep of this process (its ``result`` holds the
        per-microbatch losses on the last pipeline stage), or None.
    """

    def __init__(self, *call: Any, step: TrainStep | None = None, **fields: Any) -> None:
        super().__init__(*call, **fields)  # function, args, kwargs[, state, result]
        self.step = step

    @property
    def optimizer(self) -> Any:
        """The MegatronOptimizer instance."""
        return self.args[0]


class _State(threading.local):
    """Per-thread position in the training loop."""

    def __init__(self) -> None:
        self.step: TrainStep | None = None
        self.last_train_step: TrainStep | None = None
        self.train_steps = 0
        self.optimizer_depth = 0


_STATE = _State()


def reset() -> None:
    """Forget the loop position (a new activation starts counting from 0)."""
    _STATE.step = _STATE.last_train_step = None
    _STATE.train_steps = 0


def current_step() -> TrainStep | None:
    """The TrainStep running in this thread, if any."""
    return _STATE.step


def last_train_step() -> TrainStep | None:
    """The most recent training (not forward-only) TrainStep of this thread."""
    return _STATE.last_train_step


def _no_manager() -> Any | None:
    return None


_MANAGER_OF: list[Callable[[], Any | None]] = [_no_manager]


def bind(manager_of: Callable[[], Any | None]) -> None:
    """Where the patched functions find the active pluggy manager: activation hands over its
    ``active_manager`` (so this room never imports activation back)."""
    _MANAGER_OF[0] = manager_of


def active_manager() -> Any | None:
    """The active pluggy manager, as the bound ``manager_of`` answers (None before binding)."""
    return _MANAGER_OF[0]()


def _hook(name: str) -> Any | None:
    """The pluggy hook caller when some plugin wraps it, else None (call Megatron directly)."""
    pm = active_manager()
    if pm is None:
        return None
    caller = getattr(pm.hook, name)
    return caller if len(caller.get_hookimpls()) > 1 else None


def wrap_schedule(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Patch factory for ``schedules.forward_backward_*``: fire ``titan_train_step``."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            step = TrainStep(original, args, kwargs, schedule=kind, index=_STATE.train_steps)
            outer, _STATE.step = _STATE.step, step
            try:
                hook = _hook("titan_train_step")
                result = step.run() if hook is None else hook(step=step)
            finally:
                _STATE.step = outer
                if not step.forward_only:
                    _STATE.train_steps += 1
                    _STATE.last_train_step = step
            return result

        return forward_backward

    return factory


def wrap_microbatch(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Patch factory for ``schedules.forward_step`` / ``backward_step`` (and 0.17+'s
    ``backward_step_multimodule``, whose tensors are dicts keyed by module name)."""
    hook_name = f"titan_{phase}_microbatch"

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def microbatch(*args: Any, **kwargs: Any) -> Any:
            hook = _hook(hook_name)
            if hook is None:
                return original(*args, **kwargs)
            return hook(call=Microbatch(original, args, kwargs, phase=phase, step=_STATE.step))

        return microbatch

    return factory


def wrap_graphed_optimizer_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory for ``OptimizerCudaGraphWrapper.__call__`` (megatron-core 0.17+,
    ``--optimizer-cuda-graph``): Megatron-LM replaces ``optimizer.step`` with this wrapper, which
    captures the step once and then *replays* the graph, so the optimizer's own (patched) ``step``
    runs only until the capture. Hooking the wrapper fires ``titan_optimizer_step`` once per
    training-loop call on every step, replayed ones included; the inner ``step`` runs unhooked
    (nested). The hook's ``optimizer`` is the optimizer the wrapper steps. After a replay the
    result is the one the capture returned: its tensors are refreshed by the replay, a Python
    number in it is not (a plugin reading the grad norm must read a tensor)."""

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 (the patched name)
        hook = _hook("titan_optimizer_step") if _STATE.optimizer_depth == 0 else None
        if hook is None:
            return original(self, *args, **kwargs)
        optimizer = getattr(self.optimizer_step_func, "__self__", None)

        def graphed_step(_optimizer: Any, *a: Any, **k: Any) -> Any:
            return original(self, *a, **k)

        _STATE.optimizer_depth += 1
        try:
            call = OptimizerStep(
                graphed_step, (optimizer, *args), kwargs, step=_STATE.last_train_step
            )
            return hook(step=call)
        finally:
            _STATE.optimizer_depth -= 1

    return __call__


def wrap_optimizer_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory for the optimizers' ``step``: fire ``titan_optimizer_step`` once per
    training-loop call (a nested ``step`` of a subclass or child runs unhooked)."""

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        hook = _hook("titan_optimizer_step") if _STATE.optimizer_depth == 0 else None
        _STATE.optimizer_depth += 1
        try:
            if hook is None:
                return original(*args, **kwargs)
            return hook(step=OptimizerStep(original, args, kwargs, step=_STATE.last_train_step))
        finally:
            _STATE.optimizer_depth -= 1

    return step
