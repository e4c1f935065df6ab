"""The core's own Megatron patches: the train-step hooks on megatron-core's schedules and
optimizers, and megatron.training's argument / config wiring (``titan_add_arguments``,
``titan_configure``). Registered by the core's own plugin (:mod:`titan_plugins.builtin`) through
:data:`titan_plugins.hosts.HOSTS`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import titan_plugins.hosts.megatron.train_step as train_step
from titan_plugins.hosts.megatron.lines import SUPPORTED_MEGATRON, megatron_lines
from titan_plugins.patching.record import Patch
from titan_plugins.patching.signature import Signature

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
        result = original(parser, *args, **kwargs)
        pm = train_step.active_manager()
        if pm is not None:
            group = parser.add_argument_group(title="titan plugins")
            pm.hook.titan_add_arguments.call_historic(kwargs={"group": group})
        return result

    add_megatron_arguments.__wrapped__ = original  # type: ignore[attr-defined]
    return add_megatron_arguments


def _wrap_config_from_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def core_transformer_config_from_args(*args: Any, **kwargs: Any) -> Any:
        config = original(*args, **kwargs)
        pm = train_step.active_manager()
        if pm is not None:
            pm.hook.titan_configure.call_historic(kwargs={"config": config})
        return config

    core_transformer_config_from_args.__wrapped__ = original  # type: ignore[attr-defined]
    return core_transformer_config_from_args


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
    records.append(
        Patch(
            id="core.backward_microbatch.multimodule",
            target=f"{train_step.SCHEDULES}:backward_step_multimodule",
            replace=train_step.wrap_microbatch("backward"),
            requires=(megatron_lines("0.17"),),
            signature=Signature(
                positional=("input_tensor", "output_tensor", "output_tensor_grad", "config")
            ),
            rationale="multi-module (MIMO) pipelines (0.17+) call backward_step_multimodule "
            "instead of backward_step: fire titan_backward_microbatch there too (its tensors "
            "are dicts keyed by module name)",
            upstream="schedules.py backward_step_multimodule: :514, chosen at :2156 (0.17.1); "
            ":595, chosen at :2260-2266 (0.19.0)",
            remove_when=_STEP_REMOVE_WHEN,
        )
    )
    records.append(
        Patch(
            id="core.optimizer_step.cuda_graph",
            target=f"{train_step.OPTIMIZER_CUDA_GRAPH}:OptimizerCudaGraphWrapper.__call__",
            replace=train_step.wrap_graphed_optimizer_step,
            requires=(megatron_lines("0.17"),),
            signature=Signature(positional=("self",), attrs=("OptimizerCudaGraphWrapper",)),
            rationale="--optimizer-cuda-graph replaces optimizer.step with a wrapper that "
            "replays a captured graph: the optimizer's own step (hooked below) runs only until "
            "the capture, so titan_optimizer_step fires from the wrapper, every step",
            upstream="megatron/core/optimizer/optimizer_cuda_graph.py; training.py:3633-3638",
            remove_when="megatron-core offers a callback around the optimizer step",
        )
    )
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


def core_patches() -> list[Patch]:
    """Route megatron.training's parser and config through the titan_add_arguments /
    titan_configure hooks (megatron.training exists only in a Megatron-LM checkout), and
    megatron-core's schedules and optimizers through the training-loop hooks (in this order)."""
    records = _train_step_patches()
    records.append(
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
    records += _configure_patches()
    return records


def _configure_patches() -> list[Patch]:
    """``titan_configure`` where Megatron-LM builds the model's config, per line: in
    ``arguments.py`` up to 0.17; from 0.18 in ``argument_utils.py``, whose own
    ``gpt_config_from_args`` (0.19's ``pretrain_gpt.py``) calls it there and which
    ``arguments.py`` re-exports (patched once, at its definition, so the hook fires once)."""
    common: dict[str, Any] = dict(
        replace=_wrap_config_from_args,
        signature=Signature(positional=("args",)),
        optional=True,
        remove_when="Megatron-LM offers a config plugin hook",
    )
    return [
        Patch(
            id="core.configure",
            target="megatron.training.arguments:core_transformer_config_from_args",
            requires=(megatron_lines("0.16", "0.17"),),
            rationale="Gives plugins the final TransformerConfig of unmodified training "
            "scripts; applied when arguments.py executes, before gpt_builders and "
            "pretrain_gpt from-import it.",
            upstream="Megatron-LM megatron/training/arguments.py core_transformer_config_from_args",
            **common,
        ),
        Patch(
            id="core.configure.argument_utils",
            target="megatron.training.argument_utils:core_transformer_config_from_args",
            requires=(megatron_lines("0.18"),),
            rationale="From 0.18 the config is built in argument_utils.py: gpt_config_from_args "
            "calls this module global, and arguments.py from-imports it after the patch",
            upstream="Megatron-LM megatron/training/argument_utils.py:277 (0.19), called at "
            ":451 / :497 by gpt_config_from_args; arguments.py:41 re-exports it",
            **common,
        ),
    ]
