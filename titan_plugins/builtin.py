"""The core's own plugin: core switches, and megatron.training argument/config wiring."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pluggy

from titan_plugins.hookspecs import PROJECT
from titan_plugins.patching.record import Patch
from titan_plugins.settings import Setting
from titan_plugins.switches import CORE_SETTINGS

hookimpl = pluggy.HookimplMarker(PROJECT)

_TRAINING_GATE = ("megatron-core>=0.14",)


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


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Route megatron.training's parser and config through the titan_add_arguments /
    titan_configure hooks (megatron.training exists only in a Megatron-LM checkout)."""
    register(
        Patch(
            id="core.add_arguments",
            target="megatron.training.arguments:add_megatron_arguments",
            replace=_wrap_add_arguments,
            requires=_TRAINING_GATE,
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
            optional=True,
            rationale="Gives plugins the final TransformerConfig of unmodified training "
            "scripts; applied when arguments.py executes, before gpt_builders and "
            "pretrain_gpt from-import it.",
            upstream="Megatron-LM megatron/training/arguments.py core_transformer_config_from_args",
            remove_when="Megatron-LM offers a config plugin hook",
        )
    )
