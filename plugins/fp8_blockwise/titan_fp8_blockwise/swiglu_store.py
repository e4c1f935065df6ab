"""SwiGLU whose input is kept for backward in blockwise FP8 (DeepSeek-V3's SwiGLU caching).

Megatron's ``activation_func_fp8_input_store`` (``--activation-func-fp8-input-store``) keeps the
SwiGLU input as a plain, unscaled E4M3 cast (values above 448 saturate, small ones flush to
zero). Inside the plugin's FP8 regions the same switch stores it in 1x128-tile blockwise FP8
with scales instead, and backward recomputes SwiGLU from the dequantized input. The forward
result is unchanged (computed from the high-precision input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_fp8_blockwise.quantize import Quantized, dequantize, quantize_tiles
from titan_fp8_blockwise.recipe import BlockwiseRecipe
from titan_plugins.saved_tensors import mark_activation


def _swiglu(y: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    # The same math as megatron.core.fusions.fused_bias_swiglu.swiglu / weighted_swiglu.
    y_1, y_2 = torch.chunk(y, 2, -1)
    out = F.silu(y_1) * y_2
    return out if weights is None else (out * weights).to(y.dtype)


class BlockwiseStoredSwiGLU(torch.autograd.Function):
    """``silu(y1) * y2 [* weights]`` saving y as blockwise FP8 (see the module docstring)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor | None, recipe: BlockwiseRecipe):
        q = quantize_tiles(y, recipe.fwd_dtype, recipe.scales)
        ctx.has_weights = weights is not None
        ctx.y_dtype = y.dtype
        # The FP8 copy and its scales have no grad_fn but are activations (an offloader may
        # move them); the routing weights are the caller's tensor.
        saved = [mark_activation(q.data), mark_activation(q.scale_inv)]
        ctx.save_for_backward(*saved, *([weights] if ctx.has_weights else []))
        return _swiglu(y, weights)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        data, scale_inv, *rest = ctx.saved_tensors
        y = dequantize(Quantized(data, scale_inv, (1, 128), ctx.y_dtype)).requires_grad_()
        inputs = [y] + [w.detach().requires_grad_() for w in rest]
        with torch.enable_grad():
            out = _swiglu(y, inputs[1] if ctx.has_weights else None)
        grads = torch.autograd.grad(out, inputs, grad_output)
        return grads[0], (grads[1] if ctx.has_weights else None), None


def stored_swiglu(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor | None,
    recipe: BlockwiseRecipe,
) -> torch.Tensor:
    """megatron's ``(weighted_)bias_swiglu_impl`` contract: 2-D or 3-D input, optional bias."""
    shape = x.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"swiglu input must be 2-D or 3-D, got shape {tuple(shape)}")
    y = x.reshape(-1, shape[-1])
    if bias is not None:
        y = y + bias  # autograd gives the bias its gradient; nothing extra is saved
    out = BlockwiseStoredSwiGLU.apply(y, weights, recipe)
    return out if len(shape) == 2 else out.view(shape[0], shape[1], -1)
