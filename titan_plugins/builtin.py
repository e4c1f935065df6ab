"""The core's own plugin: the core switches, the innermost implementation of each wrapper-only
hook, and the core's patches of every host (each host's room: :data:`titan_plugins.hosts.HOSTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from titan_plugins.hookspecs import hookimpl
from titan_plugins.hosts import HOSTS
from titan_plugins.settings import Setting
from titan_plugins.switches import CORE_SETTINGS

if TYPE_CHECKING:
    from titan_plugins.hosts.megatron.train_step import Call, Microbatch, OptimizerStep, TrainStep
    from titan_plugins.patching.record import Patch


def run_original(call: Call) -> Any:
    """The core's own (innermost, non-wrapper) implementation of every wrapper-only hook."""
    return call.run()


@hookimpl
def titan_settings() -> list[Setting]:
    """The registry's own switches (DESIGN §4)."""
    return list(CORE_SETTINGS)


@hookimpl(tryfirst=True)
def titan_train_step(step: TrainStep) -> Any:
    """Innermost implementation: run Megatron's schedule (plugins wrap this)."""
    return run_original(step)


@hookimpl(tryfirst=True)
def titan_forward_microbatch(call: Microbatch) -> Any:
    """Innermost implementation: run Megatron's forward_step."""
    return run_original(call)


@hookimpl(tryfirst=True)
def titan_backward_microbatch(call: Microbatch) -> Any:
    """Innermost implementation: run Megatron's backward_step."""
    return run_original(call)


@hookimpl(tryfirst=True)
def titan_optimizer_step(step: OptimizerStep) -> Any:
    """Innermost implementation: run the optimizer's step."""
    return run_original(step)


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Every host room's core patches (Megatron: the training-loop hooks on megatron-core's
    schedules and optimizers, megatron.training's parser and config wiring)."""
    for host in HOSTS.values():
        for record in host.core_patches():
            register(record)
