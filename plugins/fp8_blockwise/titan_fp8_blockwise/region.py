"""Where FP8 applies: the recipe of the innermost FP8 region, and counters of what ran in FP8.

Megatron enters ``get_fp8_context(config, layer_no)`` around every transformer layer it wants in
FP8 (and not around the embedding, the output head, or layers kept in BF16 by
``first_last_layers_bf16``). The plugin's context sets the region recipe; the patched linear
layers run in FP8 only while a region is open, exactly like TE's ``fp8_autocast``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterator

from titan_fp8_blockwise.recipe import BlockwiseRecipe

_REGION: contextvars.ContextVar[BlockwiseRecipe | None] = contextvars.ContextVar(
    "titan_fp8_blockwise_region", default=None
)
CALLS: Counter[str] = Counter()


def current() -> BlockwiseRecipe | None:
    """The recipe of the open FP8 region, or None outside any."""
    return _REGION.get()


@contextlib.contextmanager
def fp8_region(recipe: BlockwiseRecipe | None) -> Iterator[None]:
    """Run the block with ``recipe`` as the FP8 region (None: a high-precision region)."""
    token = _REGION.set(recipe)
    try:
        yield
    finally:
        _REGION.reset(token)


def count(kind: str) -> None:
    """Count one FP8 GEMM call of ``kind`` (for reports and tests)."""
    CALLS[kind] += 1
