"""Hook implementations of PLUGIN_NAME: the entry-point target (``setup.cfg``).

The core imports this module when it activates the plugin, i.e. at the first ``import
megatron``: keep it cheap, and never import megatron or torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from titan_plugins import hookimpl

from . import patches
from .settings import LOG_EVERY, SETTINGS

if TYPE_CHECKING:
    from titan_plugins.hosts.megatron.train_step import TrainStep
    from titan_plugins.patching import Patch
    from titan_plugins.settings import Setting

# A child of the core's logger: shown at INFO when the host logs INFO or TITAN_PLUGINS_DEBUG=1.
logger = logging.getLogger("titan_plugins.PLUGIN_NAME")
STEPS = {"trained": 0}


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Declare this plugin's patches."""
    for patch in patches.patches():
        register(patch)


@hookimpl
def titan_settings() -> list[Setting]:
    """This plugin's knobs (validated by the core at activation)."""
    return SETTINGS


@hookimpl(wrapper=True)
def titan_train_step(step: TrainStep) -> Any:
    """Around each call of Megatron's forward-backward schedule: count the training steps."""
    result = yield  # Megatron's schedule runs here (and any other plugin's wrapper)
    if not step.forward_only:
        STEPS["trained"] += 1
        every = LOG_EVERY.read()
        if every and STEPS["trained"] % every == 0:
            logger.info("PLUGIN_NAME: %s", titan_effects())
    return result


@hookimpl
def titan_report() -> dict[str, Any]:
    """State for ``titan-plugins list`` / ``report`` (JSON-serialisable)."""
    return {"log_every": LOG_EVERY.read()}


@hookimpl
def titan_effects() -> dict[str, Any]:
    """What this plugin did in this process so far (counted numbers, never configuration)."""
    return {"training_steps": STEPS["trained"], **patches.CALLS}
