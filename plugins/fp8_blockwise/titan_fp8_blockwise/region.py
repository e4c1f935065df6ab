"""Where FP8 applies: the recipe of the innermost FP8 region.

Megatron enters ``get_fp8_context(config, layer_no)`` around every transformer layer it wants in
FP8 (and not around the embedding, the output head, or layers kept in BF16 by
``first_last_layers_bf16``). The plugin's context sets the region recipe; the patched linear
layers run in FP8 only while a region is open, exactly like TE's ``fp8_autocast``.
Light (no torch): the patched functions read it while Megatron imports and on every call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING

from titan_fp8_blockwise.effects import CALLS, count_call

if TYPE_CHECKING:
    from titan_fp8_blockwise.recipe import BlockwiseRecipe

__all__ = ["CALLS", "count", "current", "fp8_region"]

_REGION: contextvars.ContextVar[BlockwiseRecipe | None] = contextvars.ContextVar(
    "titan_fp8_blockwise_region", default=None
)
count = count_call  # one FP8 layer call of ``kind`` (kept under its former name)


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
