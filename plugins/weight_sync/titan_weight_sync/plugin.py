"""Hook implementations of weight_sync: the entry-point target (``setup.cfg``).

The core imports this module when it activates the plugin (at the first ``import megatron`` of a
trainer, and in every SGLang process through the ``sglang.srt.plugins`` entry point): keep it
cheap, and never import SGLang, Megatron or torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from titan_plugins import hookimpl

from . import patches, stats
from .settings import PROTOCOL, SECRET_FILE, SETTINGS, STAGING_BYTES

if TYPE_CHECKING:
    from titan_plugins.patching import Patch
    from titan_plugins.settings import Setting


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Declare the engine-side patch (SGLang; it waits for SGLang's module, which a trainer
    never imports)."""
    for patch in patches.patches():
        register(patch)


@hookimpl
def titan_settings() -> list[Setting]:
    """This plugin's knobs (validated by the core at activation)."""
    return SETTINGS


@hookimpl
def titan_report() -> dict[str, Any]:
    """State for ``titan-plugins list`` / ``report`` (JSON-serialisable)."""
    return {
        "protocol": PROTOCOL.read(),
        "secret_file": SECRET_FILE.read() or "(unset: engines accept no trainer)",
        "staging_bytes": int(STAGING_BYTES.read()),
    }


@hookimpl
def titan_effects() -> dict[str, Any]:
    """What weight_sync did in this process: syncs, tensors and bytes written (trainer); hellos,
    commits, tensors and bytes loaded, refusals (engine)."""
    return stats.snapshot()
