"""The core's own plugin: core switches, and megatron.training argument/config wiring."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from titan_plugins import train_step
from titan_plugins.hookspecs import hookimpl
from titan_plugins.patching.gates import SUPPORTED_MEGATRON
from titan_plugins.patching.record import Patch
from titan_plugins.patching.signature import Signature
from titan_plugins.settings import Setting
from titan_plugins.switches import CORE_SETTINGS

_TRAINING_GATE = ("megatron-core>=0.14",)
_CORE_GATE = (SUPPORTED_MEGATRON,)
# What the training-loop wrappers read from the calls they wrap (checked on the imported code,
# so a fork or a pre-release of the supported line is judged by what it really has).
_SCHEDULE_SIGNATURE = Signature(
    params=("forward_step_func", "data_iterator", "model", "num_microbatches", "forward_only")
)
_MICROBATCH_SIGNATURES = {
    "forward": Signature(
        positional=(
            "forward_step_func",
            "data_iterator",
            "model",
            "num_microbatches",
            "input_tensor",
        ),
        params=("vp_stage",),
    ),
    "backward": Signature(positional=("input_tensor", "output_tensor", "output_tensor_grad")),
}
_OPTIMIZER_SIGNATURE = Signature(positional=("self",))
_STEP_REMOVE_WHEN = (
    "megatron-core offers callbacks around a training iteration and its microbatches"
)


def _wrap_add_arguments(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_megatron_arguments(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        from titan_plugins.activation import active_manager

        result = original(parser, *args, **kwargs)
        pm = active_manager()
        if pm is not None:
            group = parser.add_argument_group(title="titan plugins")
            pm.hook.titan_add_arguments.call_historic(kwargs={"group": group})
        return result

    add_megatron_arguments.__wrapped__ = original  # type: ignore[attr-defined]
    return add_megatron_arguments


def _wrap_config_from_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def core_transformer_config_from_args(*args: Any, **kwargs: Any) -> Any:
        from titan_plugins.activation import active_manager

        config = original(*args, **kwargs)
        pm = active_manager()
        if pm is not None:
            pm.hook.titan_configure.call_historic(kwargs={"config": config})
        return config

    core_transformer_config_from_args.__wrapped__ = original  # type: ignore[attr-defined]
    return core_transformer_config_from_args


@hookimpl
def titan_settings() -> list[Setting]:
    """The registry's own switches (DESIGN §4)."""
    return list(CORE_SETTINGS)


@hookimpl(tryfirst=True)
def titan_train_step(step: train_step.TrainStep) -> Any:
    """Innermost implementation: run Megatron's schedule (plugins wrap this)."""
    return train_step.run_original(step)


@hookimpl(tryfirst=True)
def titan_forward_microbatch(call: train_step.Microbatch) -> Any:
    """Innermost implementation: run Megatron's forward_step."""
    return train_step.run_original(call)


@hookimpl(tryfirst=True)
def titan_backward_microbatch(call: train_step.Microbatch) -> Any:
    """Innermost implementation: run Megatron's backward_step."""
    return train_step.run_original(call)


@hookimpl(tryfirst=True)
def titan_optimizer_step(step: train_step.OptimizerStep) -> Any:
    """Innermost implementation: run the optimizer's step."""
    return train_step.run_original(step)


def _train_step_patches() -> list[Patch]:
    """One record per Megatron entry point the training-loop hooks need."""
    records = [
        Patch(
            id=f"core.train_step.{kind}",
            target=f"{train_step.SCHEDULES}:{function}",
            replace=train_step.wrap_schedule(kind),
            requires=_CORE_GATE,
            signature=_SCHEDULE_SIGNATURE,
            rationale="fire titan_train_step around each forward-backward call, so plugins "
            "need no schedule patches of their own",
            upstream="schedules.py get_forward_backward_func looks these up at call time",
            remove_when=_STEP_REMOVE_WHEN,
        )
        for function, kind in train_step.SCHEDULE_KINDS.items()
    ]
    records += [
        Patch(
            id=f"core.{phase}_microbatch",
            target=f"{train_step.SCHEDULES}:{phase}_step",
            replace=train_step.wrap_microbatch(phase),
            requires=_CORE_GATE,
            signature=_MICROBATCH_SIGNATURES[phase],
            rationale=f"fire titan_{phase}_microbatch around each microbatch {phase}",
            upstream=f"schedules.py {phase}_step (a module global the schedules call)",
            remove_when=_STEP_REMOVE_WHEN,
        )
        for phase in ("forward", "backward")
    ]
    records += [
        Patch(
            id=f"core.optimizer_step.{cls}",
            target=f"{train_step.OPTIMIZER}:{cls}.step",
            replace=train_step.wrap_optimizer_step,
            requires=_CORE_GATE,
            signature=_OPTIMIZER_SIGNATURE,
            rationale="fire titan_optimizer_step around the training loop's optimizer step "
            "(grad norm and success are known only there)",
            upstream="megatron/core/optimizer/optimizer.py MegatronOptimizer subclasses",
            remove_when="megatron-core offers a callback around the optimizer step",
        )
        for cls in train_step.OPTIMIZER_CLASSES
    ]
    return records


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Route megatron.training's parser and config through the titan_add_arguments /
    titan_configure hooks (megatron.training exists only in a Megatron-LM checkout), and
    megatron-core's schedules and optimizers through the training-loop hooks."""
    for record in _train_step_patches():
        register(record)
    register(
        Patch(
            id="core.add_arguments",
            target="megatron.training.arguments:add_megatron_arguments",
            replace=_wrap_add_arguments,
            requires=_TRAINING_GATE,
            signature=Signature(positional=("parser",)),
            optional=True,
            rationale="Lets plugins add flags to unmodified pretrain_gpt.py, whose "
            "extra_args_provider slot is already taken (modelopt); parse_args looks the "
            "function up in module globals at call time.",
            upstream="Megatron-LM megatron/training/arguments.py parse_args/add_megatron_arguments",
            remove_when="Megatron-LM offers a plugin argument hook",
        )
    )
    register(
        Patch(
            id="core.configure",
            target="megatron.training.arguments:core_transformer_config_from_args",
            replace=_wrap_config_from_args,
            requires=_TRAINING_GATE,
            signature=Signature(positional=("args",)),
            optional=True,
            rationale="Gives plugins the final TransformerConfig of unmodified training "
            "scripts; applied when arguments.py executes, before gpt_builders and "
            "pretrain_gpt from-import it.",
            upstream="Megatron-LM megatron/training/arguments.py core_transformer_config_from_args",
            remove_when="Megatron-LM offers a config plugin hook",
        )
    )
