"""What this plugin does to per-rank memory, for ``titan-plugins plan`` (``titan_memory_effect``).

The offloader moves the tensors that the wrapped blocks (attention, MLP / MoE) save for
backward to host memory while their (chunk, microbatch) unit waits for its backward, and
prefetches a unit back just before its backward. It never moves what is saved outside those
blocks (the pre-norms' inputs and statistics), the embedding's or the head's tensors, or tensors
smaller than ``TITAN_ACT_OFFLOAD_MIN_BYTES``. Pure Python: no torch, no megatron.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.plan.effects import MemoryEffect, MemoryLayout

# Saved outside the wrapped blocks: the layer's pre-norms keep their inputs and statistics.
OUTSIDE_BLOCKS = frozenset(
    {"attn_norm_input", "attn_norm_stats", "mlp_norm_input", "mlp_norm_stats"}
)
# Planner modules the plugin never wraps.
UNWRAPPED_MODULES = frozenset({"embedding", "head"})


@hookimpl
def titan_memory_effect(layout: MemoryLayout) -> MemoryEffect:
    """Offload every tensor saved inside a wrapped block that is at least the minimum size;
    the newest ``layout.resident_units`` in-flight units stay on the device."""
    from titan_act_offload.config import OffloadConfig

    min_bytes = OffloadConfig.from_env().min_bytes

    def moved(tensor: Any, size: float) -> bool:
        if tensor.module in UNWRAPPED_MODULES or tensor.name in OUTSIDE_BLOCKS:
            return False
        # One planner tensor may stand for several saved ones (one per local expert).
        return size / tensor.pieces >= min_bytes

    def offloaded(tensors: Sequence[Any], sizes: Sequence[float]) -> list[bool]:
        return [moved(tensor, size) for tensor, size in zip(tensors, sizes)]

    return MemoryEffect(
        plugin="act_offload",
        label="offl",
        legend="act_offload",
        switch="TITAN_ACT_OFFLOAD=1",
        description="saved activations of waiting microbatches to host",
        offloaded=offloaded,
        resident_units=layout.resident_units,
    )
