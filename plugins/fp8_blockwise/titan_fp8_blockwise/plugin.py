"""Hook implementations of the ``fp8_blockwise`` plugin (the entry-point target).

Light at import and at activation (both happen while Megatron imports): settings, the backend
choice and patch records only. The FP8 machinery loads at its first use in an FP8 region.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.patching import Patch
from titan_plugins.settings import Setting


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Register the FP8 region, linear-layer, router, SwiGLU-store and no-TE fix patches."""
    import sys

    from titan_fp8_blockwise.effects import track
    from titan_fp8_blockwise.patches import patches

    backend = sys.modules.get("titan_fp8_blockwise.backend")  # not imported for this
    if backend is not None:
        backend.reset()  # re-read TITAN_FP8_BLOCKWISE_BACKEND on each activation
    records = patches()
    track(records)  # what each feature needs, judged from these records' status (features.py)
    for patch in records:
        register(patch)


@hookimpl
def titan_settings() -> list[Setting]:
    """The TITAN_FP8_BLOCKWISE_* knobs."""
    from titan_fp8_blockwise.settings import SETTINGS

    return list(SETTINGS)


@hookimpl(wrapper=True)
def titan_train_step(step: Any) -> Generator[None, Any, Any]:
    """One forward-backward call is one step: weights are quantized again from here on (the
    distributed optimizer updates them without bumping their version counters)."""
    from titan_fp8_blockwise import weight_cache

    weight_cache.next_step()
    return (yield)


@hookimpl
def titan_memory_effect(layout: Any) -> Any:
    """What the plugin does to per-rank memory, for ``titan-plugins plan``
    (``memory_effect.py``: imported here, not while megatron loads)."""
    from titan_fp8_blockwise.memory_effect import titan_memory_effect as effect

    return effect(layout)


@hookimpl
def titan_configure(config: Any) -> None:
    """Apply TITAN_FP8_BLOCKWISE_FORCE to a megatron.training config and validate its shapes."""
    from titan_fp8_blockwise import backend, settings

    if settings.FORCE.read() and not backend.wants_blockwise(config):
        config.fp8 = config.fp8 or "e4m3"
        config.fp8_recipe = "blockwise"
    backend.recipe_for(config)  # raises ValueError naming the misfit dimension


@hookimpl
def titan_report() -> dict[str, Any]:
    """Whether the FP8 linear layers run (``active``; else ``inactive_reason``: a patch they
    need is not applied on this Megatron), each feature's state, backend, knobs, FP8 layer calls
    by kind and the weight cache's counters."""
    from titan_fp8_blockwise import backend, effects, features, settings

    aside = features.inactive_reason(features.LINEAR)
    return {
        "active": aside is None,
        **({"inactive_reason": aside} if aside else {}),
        "features": features.status(),
        "backend": backend.resolve_backend(),
        "scales": settings.SCALES.read(),
        "high_precision": sorted(settings.high_precision()),
        "force": settings.FORCE.read(),
        "fp8_gemm_calls": dict(effects.CALLS),  # FP8 layer forwards by kind
        "weight_cache": dict(effects.WEIGHT_CACHE),
    }


@hookimpl
def titan_effects() -> dict[str, Any]:
    """What ran in FP8 in this process: FP8 GEMMs (all passes and per pass), FP8 layer calls,
    weight quantizations (see ``titan_fp8_blockwise.effects.effects``). Where the FP8 linear
    layers stand aside (a patch they need is not applied on this Megatron): ``stepped_aside``
    (the patches) and only the counters that are not zero."""
    from titan_fp8_blockwise import effects, features

    counts: dict[str, Any] = effects.effects()
    aside = features.short(features.LINEAR)
    if aside is None:
        return counts
    return {"stepped_aside": aside, **{k: v for k, v in counts.items() if v}}


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
