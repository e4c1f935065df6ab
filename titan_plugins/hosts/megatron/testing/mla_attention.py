"""A core attention for megatron-core's multi-latent attention (MLA) on CPU.

TEST-TIME ONLY, like the rest of the CPU harness. MLA (DeepSeek-V3, Kimi-K2) builds its core
attention with separate query/key and value head sizes (``k_channels=q_head_dim``,
``v_channels=v_head_dim``, ``softmax_scale`` from its own rope scaling). The only core attention
megatron-core has without Transformer Engine, ``DotProductAttention``, takes neither size
(0.16.1 through 0.19.x: ``TypeError ... unexpected keyword argument 'k_channels'``), so on a CPU
machine no MLA model can be built. ``MLACoreAttention`` is megatron's ``DotProductAttention``
with the two sizes: its math is upstream's (``baddbmm`` of query and key scaled by
``softmax_scale``, megatron's fused-or-not masked softmax, ``bmm`` with the value), only the
output's width is the value heads' (``heads x v_head_dim``) instead of ``heads x kv_channels``.
It goes into a model by spec substitution (``with_mla_core_attention``), never by editing
megatron.
"""

from __future__ import annotations

import inspect
from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["MLACoreAttention", "with_mla_core_attention"]

# what this line's DotProductAttention takes (0.16.1 has no pg_collection in some builds)
_TAKES = frozenset(inspect.signature(DotProductAttention.__init__).parameters)


class MLACoreAttention(DotProductAttention):
    """``DotProductAttention`` with MLA's query/key and value head sizes."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Build upstream's core attention, then size its output by the value heads.

        ``k_channels`` only matters where MLA gives no ``softmax_scale`` (its default scale is
        ``1/sqrt(q_head_dim)``, not upstream's ``1/sqrt(kv_channels)``).
        """
        if softmax_scale is None and k_channels is not None:
            softmax_scale = k_channels**-0.5
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            **{key: value for key, value in kwargs.items() if key in _TAKES},
        )
        # read (and set around a call) by MLA's _run_core_attention on 0.19 when it absorbs
        # the value projection; here it sizes the output
        self.hidden_size_per_attention_head_v = v_channels or self.hidden_size_per_attention_head

    def forward(self, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        """Upstream's forward; the context's width follows the value heads actually given."""
        # upstream views the context as [sq, b, hidden_size_per_partition]: make that
        # heads x the value head size, which is what the bmm with ``value`` produced
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * value.size(-1)
        return super().forward(query, key, value, attention_mask, *args, **kwargs)


def with_mla_core_attention(spec: Any) -> Any:
    """Put ``MLACoreAttention`` into every MLA layer of ``spec`` (a layer ``ModuleSpec`` or a
    block spec with ``layer_specs``), in place; other layers are left as they are. Returns
    ``spec``."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        submodules = getattr(attention, "submodules", None)
        if isinstance(attention, ModuleSpec) and hasattr(submodules, "linear_kv_down_proj"):
            submodules.core_attention = MLACoreAttention
    return spec
