"""Which implementation serves a megatron config, and whether its shapes fit the block layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_fp8_blockwise import settings

if TYPE_CHECKING:
    from titan_fp8_blockwise.recipe import BlockwiseRecipe

ALIGN = 16  # every GEMM dimension: cuBLAS/TE block-scaled FP8 (megatron's get_fp8_align_size)
_ATTR = "_titan_fp8_blockwise_recipe"
_resolved: dict[str, str] = {}
_aside_warned: set[str] = set()


def reset() -> None:
    """Forget the resolved backend (tests, re-activation)."""
    _resolved.clear()
    _aside_warned.clear()


def resolve_backend() -> str:
    """``"te"`` (megatron's own TransformerEngine path) or ``"torch"`` (the plugin's layers).

    ``auto`` takes TE when ``platform.probe_te_blockwise()`` finds Float8BlockScaling; ``te``
    without it warns and falls back (raises ``SettingError`` under TITAN_PLUGINS_STRICT=1).
    """
    choice = settings.BACKEND.read()
    if choice in _resolved:
        return _resolved[choice]
    backend = "torch"
    if choice != "torch":
        from titan_plugins import platform

        probe = platform.probe_te_blockwise()
        if probe.available:
            backend = "te"
        elif choice == "te":
            from titan_plugins.settings import complain

            complain(
                f"fp8_blockwise: {settings.BACKEND.name}=te but {probe.detail}; using the plugin's "
                f"pure-torch blockwise FP8 instead (fix: {probe.fix})"
            )
    _resolved[choice] = backend
    return backend


def wants_blockwise(config: Any) -> bool:
    """Did megatron's config ask for blockwise FP8 (``fp8`` set, ``fp8_recipe == "blockwise"``)?"""
    return (
        bool(getattr(config, "fp8", None))
        and str(
            getattr(getattr(config, "fp8_recipe", ""), "value", getattr(config, "fp8_recipe", ""))
        )
        == "blockwise"
    )


def _gemm_dims(config: Any) -> dict[str, int]:
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp
    dims = {"hidden_size": config.hidden_size}
    if getattr(config, "ffn_hidden_size", None):
        dims[f"ffn_hidden_size / tensor_model_parallel_size ({tp})"] = config.ffn_hidden_size // tp
    moe_ffn = getattr(config, "moe_ffn_hidden_size", None)
    if getattr(config, "num_moe_experts", None) and moe_ffn:
        dims[f"moe_ffn_hidden_size / expert_tensor_parallel_size ({etp})"] = moe_ffn // etp
    kv, heads = getattr(config, "kv_channels", None), getattr(config, "num_attention_heads", 0)
    if kv and heads:
        dims[f"kv_channels * num_attention_heads / tensor_model_parallel_size ({tp})"] = (
            kv * heads // tp
        )
    return dims


def validate(config: Any) -> None:
    """Raise ValueError naming the constraint when a GEMM dimension cannot be block-scaled."""
    bad = {name: value for name, value in _gemm_dims(config).items() if value % ALIGN}
    if bad:
        listed = ", ".join(f"{name} = {value}" for name, value in bad.items())
        raise ValueError(
            f"fp8_blockwise: blockwise FP8 needs every GEMM dimension to be a multiple of {ALIGN} "
            f"(cuBLAS/TransformerEngine block-scaled FP8 GEMMs; partial 128-wide tiles are zero "
            f"padded), but {listed}. Choose sizes that are multiples of {ALIGN} (128 wastes "
            f"nothing), or train this model without FP8 (TITAN_FP8_BLOCKWISE=0 and no --fp8-*)."
        )


def recipe_for(config: Any) -> BlockwiseRecipe | None:
    """The plugin's recipe for ``config``, or None when the plugin does not serve it.

    None when the config does not ask for blockwise FP8, when TransformerEngine serves it, or
    when a patch the FP8 linear layers need is not applied on this Megatron (the plugin stands
    aside rather than run half patched: ``features``; one warning says so). The first call per
    config validates its dimensions (ValueError on a misfit).
    """
    if wants_blockwise(config) and resolve_backend() == "torch" and _aside():
        return None  # asked on every use: a patch still pending now may be applied later
    cached = getattr(config, _ATTR, None)
    if cached is not None:
        return cached or None
    recipe: BlockwiseRecipe | bool = False
    if wants_blockwise(config) and resolve_backend() == "torch":
        from titan_fp8_blockwise.recipe import BlockwiseRecipe

        validate(config)
        recipe = BlockwiseRecipe.from_format(str(config.fp8), settings.SCALES.read())
    try:
        setattr(config, _ATTR, recipe)
    except AttributeError:
        pass
    return recipe or None


def _aside() -> bool:
    """Do the FP8 linear layers stand aside in this process? (Warns once per reason.)"""
    from titan_fp8_blockwise import features  # the patch records' states, asked at run time

    why = features.inactive_reason(features.LINEAR)
    if why is None:
        return False
    if why not in _aside_warned:
        _aside_warned.add(why)
        import logging

        logging.getLogger("titan_plugins.fp8_blockwise").warning("fp8_blockwise: %s", why)
    return True
