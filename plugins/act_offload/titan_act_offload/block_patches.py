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

# Block name -> forwards that run it ("module:Class.forward", optional?).
BLOCK_TARGETS: dict[str, tuple[tuple[str, bool], ...]] = {
    "attention": (
        ("megatron.core.transformer.attention:Attention.forward", False),
        ("megatron.core.transformer.multi_latent_attention:MultiLatentAttention.forward", True),
    ),
    "mlp": (("megatron.core.transformer.mlp:MLP.forward", False),),
    "moe": (("megatron.core.transformer.moe.moe_layer:MoELayer.forward", False),),
    "experts": (
        ("megatron.core.transformer.moe.experts:SequentialMLP.forward", False),
        ("megatron.core.transformer.moe.experts:GroupedMLP.forward", True),
        ("megatron.core.transformer.moe.experts:TEGroupedMLP.forward", True),
    ),
    "layer": (("megatron.core.transformer.transformer_layer:TransformerLayer.forward", False),),
}


def block_factory(runtime: Runtime, name: str, target: str) -> Callable[[Any], Any]:
    """Patch factory: wrap a module forward so it runs inside the offloader's hooks."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        runtime.blocks_patched.add(target)

        @functools.wraps(original)
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            if runtime.step is None:
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
    from titan_plugins.patching import SUPPORTED_MEGATRON, Patch, Signature

    records = []
    for name in runtime.settings.modules:
        for target, optional in BLOCK_TARGETS[name]:
            cls_attr = target.split(":", 1)[1]
            records.append(
                Patch(
                    id=f"act_offload.block.{name}.{cls_attr}",
                    target=target,
                    replace=block_factory(runtime, name, target),
                    requires=SUPPORTED_MEGATRON,
                    signature=Signature(positional=("self",)),  # passes everything through
                    rationale=f"offload the tensors autograd saves inside {cls_attr} ({name})",
                    upstream=target.replace(":", " "),
                    remove_when=REMOVE_WHEN,
                    optional=optional,
                )
            )
    return records
