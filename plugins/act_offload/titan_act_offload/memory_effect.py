"""What this plugin does to per-rank memory, for ``titan-plugins plan`` (``titan_memory_effect``).

The offloader moves what the wrapped blocks (attention, MLP / MoE) save for backward to host
memory while their (chunk, microbatch) unit waits for its backward, block by block, and brings
each block back just ahead of its backward. It never moves what is saved outside those blocks
(the pre-norms' inputs and statistics), the embedding's or the head's tensors. Within a block it
applies its size rule: a fixed ``TITAN_ACT_OFFLOAD_MIN_BYTES``, or by default the smallest
tensors that together make at most ``TITAN_ACT_OFFLOAD_KEEP_FRACTION`` of the block's bytes stay.
Pure Python: no torch, no megatron.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from titan_act_offload.settings import OffloadSettings
from titan_plugins.plan.effects import MemoryEffect, MemoryLayout

# Saved outside the wrapped blocks: the layer's pre-norms keep their inputs and statistics.
OUTSIDE_BLOCKS = frozenset(
    {"attn_norm_input", "attn_norm_stats", "mlp_norm_input", "mlp_norm_stats"}
)
# Planner modules the plugin never wraps.
UNWRAPPED_MODULES = frozenset({"embedding", "head"})
MLP_STARTS = "mlp_norm_input"  # the planner lists a layer's attention part, then its MLP part


def blocks_of(tensors: Sequence[Any]) -> list[list[int]]:
    """Indices of the layer's tensors saved inside each wrapped block (attention, then MLP/MoE)."""
    attention: list[int] = []
    mlp: list[int] = []
    current = attention
    for index, tensor in enumerate(tensors):
        if tensor.name == MLP_STARTS:
            current = mlp
        if tensor.module in UNWRAPPED_MODULES or tensor.name in OUTSIDE_BLOCKS:
            continue
        current.append(index)
    return [block for block in (attention, mlp) if block]


def moved_in_block(
    tensors: Sequence[Any], sizes: Sequence[float], block: list[int], settings: OffloadSettings
) -> set[int]:
    """The block's tensors the size rule lets go to host (per saved tensor: an entry may stand
    for several, one per local expert)."""
    if settings.min_bytes is not None:
        return {i for i in block if sizes[i] / tensors[i].pieces >= settings.min_bytes}
    allowance = settings.keep_fraction * sum(sizes[i] for i in block)
    kept = 0.0
    moved = set(block)
    for i in sorted(block, key=lambda i: sizes[i] / tensors[i].pieces):
        if kept + sizes[i] > allowance:
            break
        kept += sizes[i]
        moved.discard(i)
    return moved


def titan_memory_effect(layout: MemoryLayout) -> MemoryEffect:
    """Offload what the wrapped blocks save, by the plugin's size rule; the newest
    ``layout.resident_units`` in-flight units stay whole on the device (the plugin holds at most
    about three blocks at a time: the one staged in forward, or the one backward reads and the
    one prefetched; ``plan --act-offload-resident 1`` models that when a unit has >= 3 blocks)."""
    settings = OffloadSettings.from_env()

    def offloaded(tensors: Sequence[Any], sizes: Sequence[float]) -> list[bool]:
        moved: set[int] = set()
        for block in blocks_of(tensors):
            moved |= moved_in_block(tensors, sizes, block, settings)
        return [i in moved for i in range(len(tensors))]

    return MemoryEffect(
        plugin="act_offload",
        label="offl",
        legend="act_offload",
        switch="TITAN_ACT_OFFLOAD=1",
        description="saved activations of waiting microbatches to host",
        offloaded=offloaded,
        resident_units=layout.resident_units,
    )
