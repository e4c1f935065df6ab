"""What this plugin does to per-rank memory, for ``titan-plugins plan`` (``titan_memory_effect``).

Linear layers save their inputs for backward as E4M3 plus one fp32 scale per 1x128 token tile
(TE's ``Float8BlockScaling`` layout, which megatron's ``--fp8-recipe blockwise`` also uses), and
experts pad their tokens to the FP8 GEMM alignment; the output head and the router stay in high
precision. The planner's saved tensors carry that layout (``fp8_bytes()``). Pure Python.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.plan.effects import MemoryEffect, MemoryLayout


def stored_bytes(tensor: Any, size: float) -> float:
    """Device bytes of a saved tensor when the plugin's layers save it."""
    return tensor.fp8_bytes()


def titan_memory_effect(layout: MemoryLayout) -> MemoryEffect:
    """Blockwise-FP8 storage of linear-layer inputs (the same for every layout)."""
    switch, flags = "TITAN_FP8_BLOCKWISE=1", "--fp8-format e4m3 --fp8-recipe blockwise"
    what = "linear-layer inputs saved as FP8 + 1x128 scales"
    return MemoryEffect(
        "fp8_blockwise", "fp8", "fp8_blockwise storage", switch, flags, what, stored_bytes
    )
