"""Patch records for the forwards of the offloaded blocks (attention, MLP, MoE layer, experts,
whole layer): each pushes the offloader's saved-tensor hooks around the module's forward while
a training schedule runs.

The schedule itself (which unit runs forward or backward, when to prefetch) comes from the
core's training-loop hooks (see ``plugin.py``). Nothing here imports megatron or torch: the
factories receive the original forward from the core's patch engine when the target module
executes, and the offloader is built at the first schedule call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_act_offload.runtime import Runtime

REMOVE_WHEN = "megatron-core offers module-level saved-tensor hooks per (chunk, microbatch)"

# Block name -> forwards that run it: ("module:Class.forward", optional?, megatron lines or None
# for every supported line). A target upstream removed keeps its record, gated on the lines that
# have it, so later lines report it as written for another line (not as a missing module).
BLOCK_TARGETS: dict[str, tuple[tuple[str, bool, tuple[str, str] | None], ...]] = {
    "attention": (
        ("megatron.core.transformer.attention:Attention.forward", False, None),
        (
            "megatron.core.transformer.multi_latent_attention:MultiLatentAttention.forward",
            True,
            None,
        ),
    ),
    "mlp": (("megatron.core.transformer.mlp:MLP.forward", False, None),),
    "moe": (("megatron.core.transformer.moe.moe_layer:MoELayer.forward", False, None),),
    "experts": (
        ("megatron.core.transformer.moe.experts:SequentialMLP.forward", False, None),
        # The legacy grouped GEMM: removed in 0.17 (upstream commit 2caa681a1d, #3410).
        ("megatron.core.transformer.moe.experts:GroupedMLP.forward", True, ("0.16", "0.16")),
        ("megatron.core.transformer.moe.experts:TEGroupedMLP.forward", True, None),  # TE only
    ),
    "layer": (
        ("megatron.core.transformer.transformer_layer:TransformerLayer.forward", False, None),
    ),
}


def block_factory(runtime: Runtime, name: str, target: str) -> Callable[[Any], Any]:
    """Patch factory: wrap a module forward so it runs inside the offloader's hooks."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        runtime.blocks_patched.add(target)

        @functools.wraps(original)
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            step = runtime.step
            if step is None or name in step.blocks_aside:
                return original(self, *args, **kwargs)
            block = runtime.offloader.enter_block(name)
            if block is None:
                return original(self, *args, **kwargs)
            try:
                return original(self, *args, **kwargs)
            finally:
                runtime.offloader.exit_block(block)

        return forward

    return factory


def patches(runtime: Runtime) -> list[Any]:
    """The Patch records of the configured blocks."""
    from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON, megatron_lines
    from titan_plugins.patching import Patch, Signature

    records = []
    for name in runtime.settings.modules:
        for target, optional, lines in BLOCK_TARGETS[name]:
            cls_attr = target.split(":", 1)[1]
            records.append(
                Patch(
                    id=f"act_offload.block.{name}.{cls_attr}",
                    target=target,
                    replace=block_factory(runtime, name, target),
                    requires=megatron_lines(*lines) if lines else SUPPORTED_MEGATRON,
                    signature=Signature(positional=("self",)),  # passes everything through
                    rationale=f"offload the tensors autograd saves inside {cls_attr} ({name})",
                    upstream=target.replace(":", " "),
                    remove_when=REMOVE_WHEN,
                    optional=optional,
                )
            )
    return records
