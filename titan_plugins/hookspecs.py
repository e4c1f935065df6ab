"""Hook specifications of the Titan plugin registry (all prefixed ``titan_``).

Plugins implement these with ``@titan_plugins.hookimpl``. The core calls them at activation
(``titan_register_patches``, ``titan_settings``), from Megatron's argument parsing and config
(``titan_add_arguments``, ``titan_configure``), when a backend is chosen (``titan_moe_dispatcher``,
``titan_p2p_communicator``), and from the CLI (``titan_report``, ``titan_doctor``,
``titan_memory_effect``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from titan_plugins.doctor import Check
    from titan_plugins.hosts.megatron.train_step import Microbatch, OptimizerStep, TrainStep
    from titan_plugins.patching import Patch
    from titan_plugins.plan.effects import MemoryEffect, MemoryLayout
    from titan_plugins.settings import Setting

PROJECT = "titan"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)  # the one marker; re-exported as titan_plugins.hookimpl

# --------------------------------------------------------------------------------------------
# Activation hooks: called once per activation, for every enabled plugin.
# --------------------------------------------------------------------------------------------


@hookspec
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Declare the plugin's lazy patches.

    Fires once per activation (automatic, ``titan_plugins.apply()`` or ``titan-run``), before any
    patch is applied. Call ``register(Patch(...))`` for each patch; the engine applies it right
    after its target module executes (or at once if it is already imported), owns ordering,
    idempotence, rollback and undo, and reports the status.

    :param register: callable taking one :class:`titan_plugins.patching.Patch`.
    :return: nothing.
    """


@hookspec
def titan_settings() -> list[Setting]:
    """Declare the plugin's environment knobs (``TITAN_<NAME>_<KNOB>``).

    Fires when ``titan-plugins env`` / ``doctor`` list the switches; never needed for the plugin
    to work (plugins read their knobs lazily with :mod:`titan_plugins.settings`).

    :return: a list of :class:`titan_plugins.settings.Setting`.
    """


# --------------------------------------------------------------------------------------------
# Host hooks: Megatron arguments and configuration.
# --------------------------------------------------------------------------------------------


@hookspec(historic=True)
def titan_add_arguments(group: argparse._ArgumentGroup) -> None:
    """Add command-line flags to megatron.training's parser (a convenience over env vars).

    Historic: fires when megatron.training builds its parser (the core wraps
    ``megatron.training.arguments.add_megatron_arguments``) and is replayed to plugins
    registered later, so no plugin misses it. slime / miles reject unknown flags: every flag
    must have an environment variable equivalent.

    :param group: the argparse group ``titan plugins``.
    :return: nothing.
    """


@hookspec(historic=True)
def titan_configure(config: Any) -> None:
    """See the final Megatron ``TransformerConfig`` built from parsed arguments.

    Historic: fires each time megatron.training converts args to a config
    (``core_transformer_config_from_args``) and is replayed to plugins registered later. A plugin
    may validate the config and raise ``ValueError`` naming the offending field.

    :param config: the ``TransformerConfig`` instance (mutable).
    :return: nothing.
    """


# --------------------------------------------------------------------------------------------
# Training-loop hooks: the core patches Megatron once and calls these; implement them only as
# wrappers (``@hookimpl(wrapper=True)``, ``result = yield``, return it). The core's own
# implementation is the innermost one: it runs Megatron's original function. A plugin that
# implements one of them without ``wrapper=True`` is refused at load.
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def titan_train_step(step: TrainStep) -> Any:
    """Wrap one call of Megatron's forward-backward schedule (one iteration, or an evaluation
    pass when ``step.forward_only``).

    Firstresult: the core's implementation, the only non-wrapper one, runs Megatron's function.

    Fires for every call of ``schedules.forward_backward_no_pipelining`` / ``_pipelining_without_
    interleaving`` / ``_pipelining_with_interleaving`` (Megatron-LM's ``train_step``, slime,
    miles and plain megatron.core loops all call these), in every rank.

    :param step: a :class:`titan_plugins.hosts.megatron.train_step.TrainStep`: ``schedule``,
        ``index``, ``forward_only``, ``model``, ``num_microbatches``, the call's ``args`` /
        ``kwargs``, and ``state`` (scratch per plugin).
    :return: the schedule's result (per-microbatch loss dicts on the last pipeline stage, ``[]``
        elsewhere): a wrapper returns what ``yield`` gave it.
    """


@hookspec(firstresult=True)
def titan_forward_microbatch(call: Microbatch) -> Any:
    """Wrap one ``schedules.forward_step`` (the forward of one microbatch on one model chunk).

    Firstresult: the core's implementation, the only non-wrapper one, runs Megatron's function.

    :param call: a :class:`titan_plugins.hosts.megatron.train_step.Microbatch` (``model``,
        ``input_tensor``, ``vp_stage``, ``step``: the running TrainStep).
    :return: forward_step's result (output tensor, number of tokens).
    """


@hookspec(firstresult=True)
def titan_backward_microbatch(call: Microbatch) -> Any:
    """Wrap one ``schedules.backward_step`` (the backward of one microbatch on one chunk).

    Firstresult: the core's implementation, the only non-wrapper one, runs Megatron's function.

    :param call: a :class:`titan_plugins.hosts.megatron.train_step.Microbatch` (``output_tensor``,
        ``step``).
    :return: backward_step's result (the gradient for the previous stage, or None).
    """


@hookspec(firstresult=True)
def titan_optimizer_step(step: OptimizerStep) -> Any:
    """Wrap one optimizer step of the training loop (``MegatronOptimizer.step`` of the
    optimizer the loop holds: Chained, MixedPrecision / Distributed, or FP32).

    Firstresult: the core's implementation, the only non-wrapper one, runs Megatron's function.

    Fires once per loop call (nested steps inside a chained optimizer do not fire).

    :param step: a :class:`titan_plugins.hosts.megatron.train_step.OptimizerStep` (``optimizer``;
        ``step``: the last training TrainStep of this process, whose ``result`` holds the
        losses).
    :return: the optimizer's ``(update_successful, grad_norm, num_zeros_in_grad)``.
    """


# --------------------------------------------------------------------------------------------
# Backend hooks: the first plugin that returns something wins.
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def titan_moe_dispatcher(config: Any) -> Any | None:
    """Choose the expert-parallel dispatch/combine backend (DeepEP v1 API).

    Firstresult: stops at the first non-None result. The plugin that wires a backend into
    Megatron answers with the one it chose (DeepEP or its own); hosts, reports and other plugins
    ask through ``active_manager().hook.titan_moe_dispatcher(config=...)``.

    :param config: the layer's ``TransformerConfig``.
    :return: a module-like object with DeepEP v1's ``Buffer`` API, or None to pass.
    """


@hookspec(firstresult=True)
def titan_p2p_communicator(config: Any) -> Any | None:
    """Choose the pipeline-parallel point-to-point transport.

    Firstresult: stops at the first non-None result. The plugin that wires a transport into
    megatron's schedules answers with the class it installs; hosts, reports and other plugins
    ask through ``active_manager().hook.titan_p2p_communicator(config=...)``.

    :param config: the model's ``ModelParallelConfig``.
    :return: a ``P2PCommunicator``-compatible class or factory, or None to pass.
    """


# --------------------------------------------------------------------------------------------
# Reporting hooks: the CLI and logs.
# --------------------------------------------------------------------------------------------


@hookspec
def titan_report() -> dict[str, Any]:
    """Describe the plugin's current state for ``titan-plugins list`` / ``report --json``.

    :return: a JSON-serialisable dict, e.g. ``{"backend": "torch.distributed", "why": "..."}``.
    """


@hookspec
def titan_effects() -> dict[str, Any]:
    """Measure what the plugin did in this process so far (after training: per-rank effects).

    Numbers counted by the plugin while it worked, never its configuration: e.g.
    ``{"fp8_gemms": 1080}``, ``{"offloaded_bytes": 123456, "peak_saved_bytes": ...}``. The demo
    gathers every rank's answers into one table; ``titan-plugins report`` shows them too.

    :return: a flat JSON-serialisable dict of numbers (empty when the plugin did nothing here).
    """


@hookspec
def titan_doctor() -> list[Check]:
    """Run the plugin's capability checks for ``titan-plugins doctor``.

    :return: a list of :class:`titan_plugins.doctor.Check`, each with a fix when not ok.
    """


# --------------------------------------------------------------------------------------------
# Planning hooks: ``titan-plugins plan`` asks, no training involved.
# --------------------------------------------------------------------------------------------


@hookspec
def titan_memory_effect(layout: MemoryLayout) -> MemoryEffect | None:
    """State what the plugin does to per-rank memory, for ``titan-plugins plan``.

    Fires once per plan, for every installed plugin whether switched on or off (the plan shows
    what each would do), never during training; must be pure Python and cheap (no torch, no
    megatron). The planner applies each answer to the saved tensors it models (it knows no
    plugin's constants) and reports the activation peak per pipeline rank with each plugin,
    and with all of them together.

    :param layout: a :class:`titan_plugins.plan.effects.MemoryLayout`: the launch's model,
        parallel layout and training setup (``layout.config``) and the planner's assumptions.
    :return: a :class:`titan_plugins.plan.effects.MemoryEffect` (how saved tensors are stored,
        which leave the device while they wait, the switch that turns it on), or None when the
        plugin does not change activation memory for this layout.
    """
