"""Quantize each weight once per training step and reuse it for every microbatch and for dgrad.

The cached copy is keyed on the step epoch (bumped once per megatron forward-backward call, see
:func:`next_step`) *and* on the tensor's version counter and storage. The version counter alone
is not enough: megatron's distributed optimizer writes updated parameters through other views of
its parameter buffer, which does not bump the parameter's own counter. The epoch alone is not
enough outside megatron's schedules (plain training loops), where the version counter catches
the optimizer's in-place update.
"""

from __future__ import annotations

import torch

from titan_fp8_blockwise.effects import WEIGHT_CACHE as _state
from titan_fp8_blockwise.quantize import Quantized, quantize_blocks

_ATTR = "_titan_fp8_blockwise_cache"


def next_step() -> int:
    """Start a new step: every cached weight is stale from now on. Returns the new epoch."""
    _state["epoch"] += 1
    return _state["epoch"]


def stats() -> dict[str, int]:
    """Cache counters (epoch, hits, misses) for reports and tests."""
    return dict(_state)


def quantized_weight(
    weight: torch.Tensor, fp8_dtype: torch.dtype, scales: str, cache: bool = True
) -> Quantized:
    """128x128-block quantization of ``weight``, computed at most once per step and version.

    :param cache: False for a weight that must be quantized at each use (a GTP-gathered weight
        lives in a pooled buffer that other weights reuse: same storage, same version).
    """
    if not cache:
        _state["misses"] += 1
        return quantize_blocks(weight.detach(), fp8_dtype, scales)
    key = (_state["epoch"], weight._version, weight.data_ptr(), weight.dtype, fp8_dtype, scales)
    cached = getattr(weight, _ATTR, None)
    if cached is not None and cached[0] == key:
        _state["hits"] += 1
        return cached[1]
    _state["misses"] += 1
    q = quantize_blocks(weight.detach(), fp8_dtype, scales)
    try:
        setattr(weight, _ATTR, (key, q))
    except (AttributeError, RuntimeError):  # a tensor subclass that refuses attributes
        pass
    return q


def drop(weight: torch.Tensor) -> None:
    """Forget the cached copy of ``weight`` (frees its FP8 bytes)."""
    if hasattr(weight, _ATTR):
        delattr(weight, _ATTR)
