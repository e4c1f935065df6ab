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

from titan_fp8_blockwise import backend, region, settings
from titan_plugins.patching import MISSING, MODULE, SUPPORTED_MEGATRON, Patch, Signature

LAYERS = "megatron.core.tensor_parallel.layers"
# What the wrapped megatron code must look like (checked on the imported code; a mismatch skips).
LINEAR_KWARGS = Signature(  # _forward_impl's replacement calls fp8_linear with these keywords
    of="linear_with_grad_accumulation_and_async_allreduce",
    params=("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad")
    + ("sequence_parallel", "grad_output_buffer", "tp_group"),
)


def _wrap_get_fp8_context(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_fp8_context(config: Any, layer_no: int = -1, is_init: bool = False) -> Any:
        recipe = backend.recipe_for(config)  # validates the shapes on first use
        if recipe is None:
            return original(config, layer_no, is_init)
        if is_init:  # FP8 parameters are not used: master weights stay high precision
            return contextlib.nullcontext()
        from megatron.core.fp8_utils import is_first_last_bf16_layer

        if is_first_last_bf16_layer(config, layer_no):
            return region.fp8_region(None)
        return region.fp8_region(recipe)

    return get_fp8_context


def _wrap_forward_impl(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        head_in_fp8 = "output_head" not in settings.high_precision()

        @functools.wraps(original)
        def _forward_impl(self: Any, input: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
            recipe = region.current()
            if recipe is None and head_in_fp8:  # linears outside transformer layers: the head
                recipe = backend.recipe_for(self.config)
            if (
                recipe is None
                or args  # megatron passes keywords; anything else is not a call we know
                or not weight.requires_grad  # frozen weights keep megatron's own path
                or kwargs.get("grad_output_buffer") is not None  # deferred embedding wgrad
            ):
                return original(self, input, weight, *args, **kwargs)
            region.count(kind + (".expert" if getattr(self, "is_expert", False) else ""))
            tp_group = kwargs.get("tp_group")
            needs_group = kwargs.get("sequence_parallel") or kwargs.get("allreduce_dgrad")
            if tp_group is None and needs_group:
                from megatron.core import parallel_state

                tp_group = parallel_state.get_tensor_model_parallel_group()
            from titan_fp8_blockwise.linear import fp8_linear

            return fp8_linear(
                input,
                weight,
                kwargs.get("bias"),
                recipe,
                sequence_parallel=bool(kwargs.get("sequence_parallel")),
                allreduce_dgrad=bool(kwargs.get("allreduce_dgrad")),
                tp_group=tp_group,
                gradient_accumulation_fusion=bool(kwargs.get("gradient_accumulation_fusion")),
            )

        return _forward_impl

    return factory


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


def _wrap_bias_swiglu(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bias_swiglu_impl(
        input: Any, bias: Any, fp8_input_store: bool = False, cpu_offload_input: bool = False
    ) -> Any:
        recipe = region.current()
        if not fp8_input_store or recipe is None or cpu_offload_input:
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
        if not fp8_input_store or recipe is None or bias is not None:
            return original(input, bias, weights, fp8_input_store)
        region.count("swiglu_store")
        from titan_fp8_blockwise.swiglu_store import stored_swiglu

        return stored_swiglu(input, None, weights, recipe)

    return weighted_bias_swiglu_impl


def _wrap_te_checkpoint(original: Any) -> Callable[..., Any]:
    def te_checkpoint(
        forward_func: Callable[..., Any],
        distribute_saved_activations: bool,
        get_rng_state_tracker: Any,
        tp_group: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if original not in (None, MISSING) and backend.resolve_backend() == "te":
            return original(
                forward_func,
                distribute_saved_activations,
                get_rng_state_tracker,
                tp_group,
                *args,
                **kwargs,
            )
        from megatron.core import tensor_parallel

        recipe = region.current()

        def run(*inputs: Any) -> Any:
            # The recomputation in backward happens outside the caller's FP8 region: re-open it.
            with region.fp8_region(recipe):
                return forward_func(*inputs, **kwargs)

        return tensor_parallel.checkpoint(run, distribute_saved_activations, *args)

    return te_checkpoint


def _te_general_gemm(original: Any) -> Any:
    return None if original is MISSING else original


def _wrap_is_te_min_version(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        from megatron.core.utils import get_te_version

        if get_te_version() is not None:
            return original(version, check_equality)
        # No TE: the MoE FP8 check (TE >= 1.7 handles zero-token experts) is served by the
        # plugin's layers; any other TE feature is simply absent (instead of a TypeError).
        return version == "1.7.0.dev0"

    return is_te_min_version


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
            replace=_te_general_gemm,
            create=True,
            rebind_aliases=False,
            requires=SUPPORTED_MEGATRON,
            signature=Signature(of=MODULE, contains=("if te_general_gemm is not None",)),
            rationale="0.16.1 binds te_general_gemm only when TE imports, but every router "
            "forward reads it: NameError without TE. None selects megatron's torch path.",
            upstream="megatron/core/transformer/moe/moe_utils.py:22-39 vs :1192 (fixed in 0.17)",
            remove_when="megatron-core >= 0.17",
        ),
        Patch(
            id="fp8_blockwise.te_version_check",
            target="megatron.core.transformer.transformer_config:is_te_min_version",
            replace=_wrap_is_te_min_version,
            rebind_aliases=False,
            requires=SUPPORTED_MEGATRON,
            signature=Signature(positional=("version", "check_equality")),
            rationale="MoE + fp8 without TE: is_te_min_version compares None to a Version and "
            "raises TypeError in TransformerConfig.__post_init__; the plugin serves MoE FP8.",
            upstream="megatron/core/transformer/transformer_config.py:1599-1605",
            remove_when="megatron-core checks HAVE_TE before comparing TE versions",
        ),
    ]
    for cls in ("ColumnParallelLinear", "RowParallelLinear"):
        records.append(
            Patch(
                id=f"fp8_blockwise.{cls}",
                target=f"{LAYERS}:{cls}._forward_impl",
                replace=_wrap_forward_impl(cls),
                requires=SUPPORTED_MEGATRON,
                signature=(Signature(positional=("self", "input", "weight")), LINEAR_KWARGS),
                rationale=f"Runs local {cls} GEMMs (attention, MLP, SequentialMLP experts, "
                "output head when allowed) through the blockwise-FP8 linear inside FP8 regions.",
                upstream=f"megatron/core/tensor_parallel/layers.py {cls}._forward_impl "
                "-> linear_with_grad_accumulation_and_async_allreduce",
                remove_when="megatron-core exposes a non-TE quantization backend hook",
            )
        )
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
    for module, create in (
        ("megatron.core.extensions.transformer_engine", False),
        ("megatron.core.transformer.transformer_block", False),
        ("megatron.core.transformer.moe.moe_layer", True),  # bound only when TE imports
    ):
        records.append(
            Patch(
                id=f"fp8_blockwise.te_checkpoint.{module.rsplit('.', 1)[-1]}",
                target=f"{module}:te_checkpoint",
                replace=_wrap_te_checkpoint,
                create=create,
                rebind_aliases=False,
                requires=SUPPORTED_MEGATRON,
                signature=Signature(of=MODULE, contains=("te_checkpoint(",)),
                rationale="With fp8, megatron recomputes (full, 'mlp', 'moe' recompute) through "
                "te_checkpoint, which is None or raises ImportError without TE; the "
                "replacement uses tensor_parallel.checkpoint and re-opens the FP8 region for "
                "the recomputation.",
                upstream="transformer_block.py:505-520, transformer_layer.py:719-731, "
                "moe_layer.py:433-442, extensions/transformer_engine.py:2262",
                remove_when="megatron-core has a non-TE quantization backend hook",
            )
        )
    return records
