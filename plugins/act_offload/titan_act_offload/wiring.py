"""Megatron-core wiring: Patch records for the schedule entry points (to learn the schedule and
the unit of every forward/backward) and for the forwards of the offloaded blocks.

Nothing here imports megatron: the factories receive the original attribute from the core's
patch engine when the target module executes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_act_offload.runtime import KIND_BY_FUNCTION, Runtime

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
REMOVE_WHEN = (
    "megatron-core exposes a schedule callback with (chunk, microbatch) per forward/backward "
    "and module-level saved-tensor hooks"
)

# Block name -> forwards that run it ("module:Class.forward", optional?).
BLOCK_TARGETS: dict[str, tuple[tuple[str, bool], ...]] = {
    "attention": (
        ("megatron.core.transformer.attention:Attention.forward", False),
        ("megatron.core.transformer.multi_latent_attention:MultiLatentAttention.forward", True),
    ),
    "mlp": (("megatron.core.transformer.mlp:MLP.forward", False),),
    "moe": (("megatron.core.transformer.moe.moe_layer:MoELayer.forward", False),),
    "experts": (
        ("megatron.core.transformer.moe.experts:SequentialMLP.forward", False),
        ("megatron.core.transformer.moe.experts:GroupedMLP.forward", True),
        ("megatron.core.transformer.moe.experts:TEGroupedMLP.forward", True),
    ),
    "layer": (("megatron.core.transformer.transformer_layer:TransformerLayer.forward", False),),
}


def schedule_factory(runtime: Runtime, kind: str) -> Callable[[Any], Any]:
    """Wrap a forward_backward_* schedule: one plan per invocation."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def schedule(*args: Any, **kwargs: Any) -> Any:
            try:
                step = runtime.begin_step(kind, kwargs)
            except Exception as err:  # never break training because the plan failed
                runtime.warn_once("plan", f"act_offload: no offload plan ({err!r}); running plain")
                step = None
            if step is None:
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                runtime.end_step(step)

        return schedule

    return factory


def forward_step_factory(runtime: Runtime) -> Callable[[Any], Any]:
    """Wrap schedules.forward_step: which unit is running forward."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            step = runtime.step
            if step is None:
                return original(*args, **kwargs)
            model = args[2] if len(args) > 2 else kwargs.get("model")
            input_tensor = args[4] if len(args) > 4 else kwargs.get("input_tensor")
            state = step.begin_forward(model, kwargs.get("vp_stage"), input_tensor)
            output = None
            try:
                output = original(*args, **kwargs)
            finally:
                step.end_forward(state, output[0] if isinstance(output, tuple) else output)
            return output

        return forward_step

    return factory


def backward_step_factory(runtime: Runtime) -> Callable[[Any], Any]:
    """Wrap schedules.backward_step: which unit is running backward (and prefetch for it)."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward_step(*args: Any, **kwargs: Any) -> Any:
            step = runtime.step
            if step is None:
                return original(*args, **kwargs)
            output_tensor = args[1] if len(args) > 1 else kwargs.get("output_tensor")
            unit = step.begin_backward(output_tensor)
            try:
                return original(*args, **kwargs)
            finally:
                step.end_backward(unit)

        return backward_step

    return factory


def block_factory(runtime: Runtime, name: str) -> Callable[[Any], Any]:
    """Wrap a module forward: push the offload hooks around it while a schedule runs."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            if runtime.step is None:
                return original(self, *args, **kwargs)
            block = runtime.offloader.enter_block(name)
            if block is None:
                return original(self, *args, **kwargs)
            try:
                return original(self, *args, **kwargs)
            finally:
                runtime.offloader.exit_block(block)

        return forward

    return factory


def patches(runtime: Runtime) -> list[Any]:
    """The Patch records for the configured blocks and the schedule entry points."""
    from titan_plugins.patching import SUPPORTED_MEGATRON, Patch, Signature

    records = []
    for function, kind in KIND_BY_FUNCTION.items():
        records.append(
            Patch(
                id=f"act_offload.schedule.{kind}",
                target=f"{SCHEDULES}:{function}",
                replace=schedule_factory(runtime, kind),
                requires=SUPPORTED_MEGATRON,
                signature=Signature(params=("model", "num_microbatches", "forward_only")),
                rationale="learn the pipeline schedule (kind, stage, chunks, microbatches) of "
                "each step to plan which microbatches to offload and when to prefetch",
                upstream="schedules.py get_forward_backward_func looks these up at call time",
                remove_when=REMOVE_WHEN,
            )
        )
    for attr, factory, signature in (  # the wrappers read args[i]: positions must hold
        (
            "forward_step",
            forward_step_factory(runtime),
            Signature(
                positional=("forward_step_func", "data_iterator", "model", "num_microbatches")
                + ("input_tensor",),
                params=("vp_stage",),
            ),
        ),
        (
            "backward_step",
            backward_step_factory(runtime),
            Signature(positional=("input_tensor", "output_tensor")),
        ),
    ):
        records.append(
            Patch(
                id=f"act_offload.{attr}",
                target=f"{SCHEDULES}:{attr}",
                replace=factory,
                requires=SUPPORTED_MEGATRON,
                signature=signature,
                rationale=f"map each {attr} call of a schedule to its (chunk, microbatch) unit",
                upstream="schedules.py forward_step / backward_step (module globals)",
                remove_when=REMOVE_WHEN,
            )
        )
    for name in runtime.config.modules:
        for target, optional in BLOCK_TARGETS[name]:
            cls_attr = target.split(":", 1)[1]
            records.append(
                Patch(
                    id=f"act_offload.block.{name}.{cls_attr}",
                    target=target,
                    replace=block_factory(runtime, name),
                    requires=SUPPORTED_MEGATRON,
                    signature=Signature(positional=("self",)),  # passes everything through
                    rationale=f"offload the tensors autograd saves inside {cls_attr} ({name})",
                    upstream=target.replace(":", " "),
                    remove_when=REMOVE_WHEN,
                    optional=optional,
                )
            )
    return records
