"""Patch records that route unmodified megatron-core through the blockwise-FP8 layers.

Light: this module is imported at activation, while Megatron imports, and most factories run
then too. The FP8 machinery (quantizer, GEMM, linear layer, SwiGLU store) and megatron are
imported inside the replacement functions, at their first call in an FP8 region.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from titan_fp8_blockwise import region, settings
from titan_fp8_blockwise.replacements import (
    GTP_KEYWORDS,
    KEYWORDS,
    _backend,
    te_general_gemm,
    wrap_forward_impl,
    wrap_is_te_min_version,
    wrap_te_checkpoint,
)
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON, megatron_lines
from titan_plugins.patching import MODULE, Patch, Signature

LAYERS = "megatron.core.tensor_parallel.layers"
# What the wrapped megatron code must look like (checked on the imported code; a mismatch skips).
LINEAR_FN = "linear_with_grad_accumulation_and_async_allreduce"
LINEAR_PARAMS = ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad")
LINEAR_PARAMS += ("sequence_parallel", "grad_output_buffer", "tp_group")
LINEAR_KWARGS = Signature(of=LINEAR_FN, params=LINEAR_PARAMS)  # what fp8_linear is given
# 0.16-0.18: weights are whole; 0.19: a GTP-sharded weight gathers itself through this protocol.
WHOLE_WEIGHTS = Signature(of=LINEAR_FN, lacks=("gtp_remat_size",))
GTP_WEIGHTS = (
    Signature(of=LINEAR_FN, params=(*LINEAR_PARAMS, "gtp_remat_size")),
    Signature(
        of="LinearWithGradAccumulationAndAsyncCommunication.forward",
        contains=("weight.all_gather_and_prefetch(fwd=True)",),
    ),
    Signature(
        of="LinearWithGradAccumulationAndAsyncCommunication.backward",
        contains=("all_gather_and_prefetch_bwd()", "wgrad_reduce_scatter(grad_weight)"),
    ),
)


def _wrap_get_fp8_context(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_fp8_context(config: Any, layer_no: int = -1, is_init: bool = False) -> Any:
        recipe = _backend().recipe_for(config)  # validates the shapes on first use
        if recipe is None:
            return original(config, layer_no, is_init)
        if is_init:  # FP8 parameters are not used: master weights stay high precision
            return contextlib.nullcontext()
        from megatron.core.fp8_utils import is_first_last_bf16_layer

        if is_first_last_bf16_layer(config, layer_no):
            return region.fp8_region(None)
        return region.fp8_region(recipe)

    return get_fp8_context


def _wrap_router_gating(original: Callable[..., Any]) -> Callable[..., Any]:
    router_in_fp8 = "router" not in settings.high_precision()

    @functools.wraps(original)
    def router_gating_linear(inp: Any, weight: Any, bias: Any, router_dtype: Any) -> Any:
        import torch

        recipe = region.current()
        if not router_in_fp8 or recipe is None or router_dtype == torch.float64:
            return original(inp, weight, bias, router_dtype)
        region.count("router")
        from titan_fp8_blockwise.linear import fp8_linear

        return fp8_linear(inp, weight, bias, recipe).to(router_dtype)

    return router_gating_linear


def _store_aside() -> bool:
    """Both SwiGLU stores are patched, or megatron's own store serves both (never a mix)."""
    from titan_fp8_blockwise import features

    return bool(features.missing(features.SWIGLU_STORE))


def _wrap_bias_swiglu(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bias_swiglu_impl(
        input: Any, bias: Any, fp8_input_store: bool = False, cpu_offload_input: bool = False
    ) -> Any:
        recipe = region.current()
        if not fp8_input_store or recipe is None or cpu_offload_input or _store_aside():
            return original(input, bias, fp8_input_store, cpu_offload_input)
        region.count("swiglu_store")
        from titan_fp8_blockwise.swiglu_store import stored_swiglu

        return stored_swiglu(input, bias, None, recipe)

    return bias_swiglu_impl


def _wrap_weighted_swiglu(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def weighted_bias_swiglu_impl(
        input: Any, bias: Any, weights: Any, fp8_input_store: bool = False
    ) -> Any:
        recipe = region.current()
        if not fp8_input_store or recipe is None or bias is not None or _store_aside():
            return original(input, bias, weights, fp8_input_store)
        region.count("swiglu_store")
        from titan_fp8_blockwise.swiglu_store import stored_swiglu

        return stored_swiglu(input, None, weights, recipe)

    return weighted_bias_swiglu_impl


def _wrap_config_post_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        if settings.FORCE.read():
            self.fp8 = self.fp8 or "e4m3"
            self.fp8_recipe = "blockwise"
        return original(self)

    return __post_init__


def patches() -> list[Patch]:
    """Every patch record of the plugin."""
    records = [
        Patch(
            id="fp8_blockwise.force_config",
            target="megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
            replace=_wrap_config_post_init,
            requires=SUPPORTED_MEGATRON,
            signature=Signature(attrs=("TransformerConfig.fp8", "TransformerConfig.fp8_recipe")),
            rationale="TITAN_FP8_BLOCKWISE_FORCE=1 acts as --fp8-format e4m3 --fp8-recipe "
            "blockwise for hosts that cannot pass megatron flags (slime / miles drivers).",
            upstream="megatron/core/transformer/transformer_config.py TransformerConfig",
            remove_when="never: it is the plugin's switch",
        ),
        Patch(
            id="fp8_blockwise.get_fp8_context",
            target="megatron.core.fp8_utils:get_fp8_context",
            replace=_wrap_get_fp8_context,
            requires=SUPPORTED_MEGATRON,
            signature=Signature(positional=("config", "layer_no", "is_init")),
            rationale="Opens the plugin's FP8 region around each transformer layer megatron "
            "wants in FP8 (TE's fp8_autocast equivalent); without TE megatron returns "
            "nullcontext(). Copies in transformer_block, combined_1f1b, "
            "model_chunk_schedule_plan and multi_token_prediction are rebound too.",
            upstream="megatron/core/fp8_utils.py:596-664, transformer_block.py:15/:711-760",
            remove_when="megatron-core exposes a non-TE quantization backend hook",
        ),
        Patch(
            id="fp8_blockwise.router_gating",
            target="megatron.core.transformer.moe.router:router_gating_linear",
            replace=_wrap_router_gating,
            requires=SUPPORTED_MEGATRON,
            signature=Signature(positional=("inp", "weight", "bias", "router_dtype")),
            rationale="Runs the MoE router GEMM in FP8 when 'router' is dropped from "
            "TITAN_FP8_BLOCKWISE_HIGH_PRECISION (DeepSeek-V3 keeps it high precision).",
            upstream="megatron/core/transformer/moe/router.py:100",
            remove_when="megatron-core exposes a non-TE quantization backend hook",
        ),
        Patch(
            id="fp8_blockwise.te_general_gemm",
            target="megatron.core.transformer.moe.moe_utils:te_general_gemm",
            replace=te_general_gemm,
            create=True,
            rebind_aliases=False,
            requires=megatron_lines("0.16", "0.16"),  # 0.17+ binds None itself
            signature=Signature(of=MODULE, contains=("if te_general_gemm is not None",)),
            rationale="0.16.1 binds te_general_gemm only when TE imports, but every router "
            "forward reads it: NameError without TE. None selects megatron's torch path.",
            upstream="megatron/core/transformer/moe/moe_utils.py:22-39 vs :1192 (fixed in 0.17)",
            remove_when="megatron-core >= 0.17",
        ),
        Patch(
            id="fp8_blockwise.te_version_check",
            target="megatron.core.transformer.transformer_config:is_te_min_version",
            replace=wrap_is_te_min_version,
            rebind_aliases=False,
            requires=SUPPORTED_MEGATRON,
            signature=Signature(positional=("version", "check_equality")),
            rationale="MoE + fp8 without TE: TransformerConfig.__post_init__ refuses it "
            "(0.16: is_te_min_version compares None to a Version, TypeError; 0.17+: "
            "get_te_version() is 0.0.0, 'Only transformer-engine>=1.7.0 supports MoE FP8'); "
            "the plugin serves MoE FP8.",
            upstream="megatron/core/transformer/transformer_config.py:1599-1605 (0.16.1), "
            ":2294-2300 (0.19); utils.py get_te_version",
            remove_when="megatron-core checks HAVE_TE before comparing TE versions",
        ),
        Patch(
            id="fp8_blockwise.te_version_check.shared_experts",
            target="megatron.core.transformer.moe.shared_experts:is_te_min_version",
            replace=wrap_is_te_min_version,
            rebind_aliases=False,
            requires=megatron_lines("0.16", "0.16"),  # 0.17+: get_te_version() is 0.0.0
            signature=Signature(positional=("version", "check_equality")),
            rationale="A shared expert (DeepSeek-V3, Kimi-K2) in an fp8 config without TE: "
            "SharedExpertMLP.__init__ asks is_te_min_version('2.6.0dev0'), which compares None "
            "to a Version on 0.16 (TypeError at model build); answered as TE-absent.",
            upstream="megatron/core/transformer/moe/shared_experts.py:65-69 (0.16.1)",
            remove_when="megatron-core >= 0.17",
        ),
    ]
    records += _linear_patches()
    for name, factory, params in (
        (
            "bias_swiglu_impl",
            _wrap_bias_swiglu,
            ("input", "bias", "fp8_input_store", "cpu_offload_input"),
        ),
        (
            "weighted_bias_swiglu_impl",
            _wrap_weighted_swiglu,
            ("input", "bias", "weights", "fp8_input_store"),
        ),
    ):
        records.append(
            Patch(
                id=f"fp8_blockwise.{name}",
                target=f"megatron.core.transformer.mlp:{name}",
                replace=factory,
                requires=SUPPORTED_MEGATRON,
                signature=Signature(positional=params),
                rationale="With activation_func_fp8_input_store, keeps the SwiGLU input in "
                "blockwise-scaled FP8 inside FP8 regions (DeepSeek-V3) instead of megatron's "
                "unscaled, saturating E4M3 cast.",
                upstream="megatron/core/fusions/fused_bias_swiglu.py (used by transformer/mlp.py)",
                remove_when="megatron-core stores activation inputs with block scales",
            )
        )
    for module, create, lines in (
        ("megatron.core.extensions.transformer_engine", False, SUPPORTED_MEGATRON),
        # 0.18 moved the recompute call to megatron/core/recompute.py (a dead None stays here)
        ("megatron.core.transformer.transformer_block", False, megatron_lines("0.16", "0.17")),
        ("megatron.core.recompute", False, megatron_lines("0.18")),  # binds TE's or None
        ("megatron.core.transformer.moe.moe_layer", True, SUPPORTED_MEGATRON),  # TE binds it
    ):
        records.append(
            Patch(
                id=f"fp8_blockwise.te_checkpoint.{module.rsplit('.', 1)[-1]}",
                target=f"{module}:te_checkpoint",
                replace=wrap_te_checkpoint,
                create=create,
                rebind_aliases=False,
                requires=lines,
                signature=Signature(of=MODULE, contains=("te_checkpoint(",)),
                rationale="With fp8, megatron recomputes (full, 'mlp', 'moe' recompute) through "
                "te_checkpoint, which is None or raises ImportError without TE; the "
                "replacement uses tensor_parallel.checkpoint and re-opens the FP8 region for "
                "the recomputation.",
                upstream="transformer_block.py:505-520 (0.16-0.17), recompute.py:15-18/:134 "
                "(0.18+), transformer_layer.py:719-731, moe_layer.py:433-442, "
                "extensions/transformer_engine.py:2262",
                remove_when="megatron-core has a non-TE quantization backend hook",
            )
        )
    return records


def _linear_patches() -> list[Patch]:
    """Column/RowParallelLinear._forward_impl, one variant per keyword set megatron passes."""
    records = []
    for cls in ("ColumnParallelLinear", "RowParallelLinear"):
        for suffix, lines, known, signature in (
            ("", megatron_lines("0.16", "0.18"), KEYWORDS, (LINEAR_KWARGS, WHOLE_WEIGHTS)),
            (".gtp", megatron_lines("0.19"), GTP_KEYWORDS, GTP_WEIGHTS),
        ):
            records.append(
                Patch(
                    id=f"fp8_blockwise.{cls}{suffix}",
                    target=f"{LAYERS}:{cls}._forward_impl",
                    replace=wrap_forward_impl(cls, known),
                    requires=lines,
                    signature=(Signature(positional=("self", "input", "weight")), *signature),
                    rationale=f"Runs local {cls} GEMMs (attention, MLP, SequentialMLP experts, "
                    "output head when allowed) through the blockwise-FP8 linear inside FP8 "
                    "regions"
                    + (
                        "; 0.19 passes gtp_remat_size: a GTP-sharded weight is gathered for "
                        "each GEMM and its gradient reduce-scattered, as megatron's own linear "
                        "does."
                        if suffix
                        else "."
                    ),
                    upstream=f"megatron/core/tensor_parallel/layers.py {cls}._forward_impl "
                    f"-> {LINEAR_FN}"
                    + (" (gtp_remat_size: 0.19, layers.py:765)" if suffix else ""),
                    remove_when="megatron-core exposes a non-TE quantization backend hook",
                )
            )
    return records
