"""Hook implementations of the ``fp8_blockwise`` plugin (the entry-point target).

Importing this module must stay cheap and must not import megatron: the patch factories and
replacements import megatron lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# the plan hook (titan_memory_effect) is registered with this module
from titan_fp8_blockwise.memory_effect import titan_memory_effect as titan_memory_effect
from titan_plugins import hookimpl
from titan_plugins.patching import Patch
from titan_plugins.settings import Setting


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Register the FP8 region, linear-layer, router, step-boundary and no-TE fix patches."""
    from titan_fp8_blockwise import backend
    from titan_fp8_blockwise.megatron_patches import patches

    backend.reset()  # re-read TITAN_FP8_BLOCKWISE_BACKEND on each activation
    for patch in patches():
        register(patch)


@hookimpl
def titan_settings() -> list[Setting]:
    """The TITAN_FP8_BLOCKWISE_* knobs."""
    from titan_fp8_blockwise.knobs import SETTINGS

    return list(SETTINGS)


@hookimpl
def titan_configure(config: Any) -> None:
    """Apply TITAN_FP8_BLOCKWISE_FORCE to a megatron.training config and validate its shapes."""
    from titan_fp8_blockwise import backend, knobs

    if knobs.force() and not backend.wants_blockwise(config):
        config.fp8 = config.fp8 or "e4m3"
        config.fp8_recipe = "blockwise"
    backend.recipe_for(config)  # raises ValueError naming the misfit dimension


@hookimpl
def titan_report() -> dict[str, Any]:
    """Backend, knobs, FP8 GEMM call counts and weight-cache counters."""
    from titan_fp8_blockwise import backend, knobs, region, weight_cache

    return {
        "backend": backend.resolve_backend(),
        "scales": knobs.scales(),
        "high_precision": sorted(knobs.high_precision()),
        "force": knobs.force(),
        "fp8_gemm_calls": dict(region.CALLS),
        "weight_cache": weight_cache.stats(),
    }


@hookimpl
def titan_doctor() -> list[Any]:
    """Whether TransformerEngine's Float8BlockScaling or the pure-torch path will serve FP8."""
    from titan_plugins import platform
    from titan_plugins.doctor import Check

    probe = platform.probe_te_blockwise()
    if probe.available:
        return [Check("fp8_blockwise.te", "ok", f"{probe.detail}: megatron's TE path is used")]
    return [
        Check(
            "fp8_blockwise.te",
            "ok",
            f"{probe.detail}: the plugin's pure-torch blockwise FP8 serves local layers",
            probe.fix,
        )
    ]
