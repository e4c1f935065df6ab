"""Hook specifications of the Titan plugin registry (all prefixed ``titan_``).

Plugins implement these with ``@titan_plugins.hookimpl``. The core calls them at activation
(``titan_register_patches``, ``titan_settings``), from Megatron's argument parsing and config
(``titan_add_arguments``, ``titan_configure``), when a backend is chosen (``titan_moe_dispatcher``,
``titan_p2p_communicator``), and from the CLI (``titan_report``, ``titan_doctor``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from titan_plugins.doctor import Check
    from titan_plugins.patching import Patch
    from titan_plugins.settings import Setting

PROJECT = "titan"
hookspec = pluggy.HookspecMarker(PROJECT)

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
def titan_doctor() -> list[Check]:
    """Run the plugin's capability checks for ``titan-plugins doctor``.

    :return: a list of :class:`titan_plugins.doctor.Check`, each with a fix when not ok.
    """
