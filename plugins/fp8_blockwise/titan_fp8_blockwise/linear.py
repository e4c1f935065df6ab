"""The blockwise-FP8 linear layer: ``y = x @ W.T + b`` with all three GEMMs in FP8.

* fprop ``y = x @ W.T``:  x in 1x128 tiles along K, W in 128x128 blocks (cached per step).
* dgrad ``dx = dy @ W``:  dy in 1x128 tiles along N; the same W blocks, transposed (a square
  block of W is a block of W.T, which is why weights use 128x128 blocks).
* wgrad ``dW = dy.T @ x``: both operands in 1x128 tiles along the token dimension, quantized
  from high precision (as TE does for its "columnwise" copies), not re-quantized from FP8.

What autograd keeps for backward is the token-tiled FP8 copy of x plus its scales (about 0.52
of the bf16 bytes); the high-precision input is not saved. Accumulation is fp32 throughout;
the output keeps the input dtype. Tensor-parallel communication mirrors megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` (synchronously): all-gather of the input for
sequence parallelism, all-reduce or reduce-scatter of dgrad.

A weight sharded by megatron 0.19's Generalized Tensor Parallelism (``gtp_remat_size > 1``) is
used through the same protocol as megatron's own linear function: the shard gathers the whole
weight for the forward (``all_gather_and_prefetch(fwd=True)``) and again for the backward
(``all_gather_and_prefetch_bwd()``), and takes the whole weight gradient, which it
reduce-scatters into its ``main_grad`` (``wgrad_reduce_scatter``). The gathered weight is
quantized at each use and never cached or kept for backward: it is a pooled buffer that other
weights reuse, and keeping it would undo the point of sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_fp8_blockwise.effects import count_gemm
from titan_fp8_blockwise.gemm import gemm
from titan_fp8_blockwise.quantize import Quantized, dequantize, quantize_tiles
from titan_fp8_blockwise.recipe import BlockwiseRecipe
from titan_fp8_blockwise.weight_cache import quantized_weight
from titan_plugins.saved_tensors import mark_activation


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _transposed(q: Quantized) -> Quantized:
    """A 128x128-block quantized [N, K] tensor viewed as the quantized [K, N] transpose."""
    return Quantized(q.data.t().contiguous(), q.scale_inv.t().contiguous(), q.tile, q.dtype)


def _full_input_t(ctx, data: torch.Tensor, scale_inv: torch.Tensor):
    """The token-tiled x.T of the whole TP group: a Quantized, or fp32 when shards misalign."""
    local = Quantized(data, scale_inv, (1, 128), ctx.x_dtype)
    if not ctx.sequence_parallel:
        return local
    world = dist.get_world_size(ctx.tp_group)
    datas = [torch.empty_like(data.view(torch.uint8)) for _ in range(world)]
    scales = [torch.empty_like(scale_inv) for _ in range(world)]
    dist.all_gather(datas, data.view(torch.uint8).contiguous(), group=ctx.tp_group)
    dist.all_gather(scales, scale_inv.contiguous(), group=ctx.tp_group)
    pieces = [
        Quantized(d.view(data.dtype), s, (1, 128), ctx.x_dtype)
        for d, s in zip(datas, scales, strict=True)
    ]
    if data.shape[1] % 128 == 0:  # shard tiles line up with the gathered tensor's tiles
        cat = Quantized(
            torch.cat([p.data for p in pieces], 1),
            torch.cat([p.scale_inv for p in pieces], 1),
            (1, 128),
            ctx.x_dtype,
        )
        return cat
    return torch.cat([dequantize(p, torch.float32) for p in pieces], dim=1)


class BlockwiseFP8LinearFunction(torch.autograd.Function):
    """Autograd function behind :func:`fp8_linear` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: BlockwiseRecipe,
        sequence_parallel: bool,
        allreduce_dgrad: bool,
        tp_group,
        gradient_accumulation_fusion: bool,
        gtp_remat_size: int,
    ) -> torch.Tensor:
        total = _gather_tokens(x, tp_group) if sequence_parallel else x
        x2 = total.reshape(-1, total.shape[-1])
        sharded = gtp_remat_size > 1
        full_w = weight.all_gather_and_prefetch(fwd=True) if sharded else weight
        q_w = quantized_weight(full_w, recipe.fwd_dtype, recipe.scales, cache=not sharded)
        y = gemm(quantize_tiles(x2, recipe.fwd_dtype, recipe.scales), q_w)
        count_gemm("fprop")
        if bias is not None:
            y = y + bias.float()
        # Only the token-tiled copy of the *local* input is kept for wgrad.
        local2 = x.reshape(-1, x.shape[-1])
        q_xt = quantize_tiles(local2.t(), recipe.fwd_dtype, recipe.scales)
        # Made here without a grad_fn, yet activations: an offloader may move them.
        ctx.save_for_backward(mark_activation(q_xt.data), mark_activation(q_xt.scale_inv))
        ctx.q_w, ctx.weight, ctx.recipe = (None if sharded else q_w), weight, recipe
        ctx.gtp = sharded
        ctx.x_dtype, ctx.x_shape, ctx.use_bias = x.dtype, x.shape, bias is not None
        ctx.sequence_parallel, ctx.allreduce_dgrad, ctx.tp_group = (
            sequence_parallel,
            allreduce_dgrad,
            tp_group,
        )
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        out = y.to(x.dtype).reshape(*total.shape[:-1], full_w.shape[0])
        # An output that is a view of a forward intermediate cannot be modified in place by the
        # caller (megatron's vocab-parallel cross entropy does so with the logits).
        return out.clone() if out._is_view() else out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        data, scale_inv = ctx.saved_tensors
        recipe, weight = ctx.recipe, ctx.weight
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        handle = dgrad = None
        q_w = ctx.q_w
        if ctx.gtp:  # gathered again, as megatron does (it also prefetches the previous weight)
            q_w = quantized_weight(
                weight.all_gather_and_prefetch_bwd(), recipe.fwd_dtype, recipe.scales, cache=False
            )
        if ctx.needs_input_grad[0]:
            q_dy = quantize_tiles(dy, recipe.bwd_dtype, recipe.scales)
            dgrad = gemm(q_dy, _transposed(q_w)).to(ctx.x_dtype)
            count_gemm("dgrad")
        if dgrad is None:
            pass
        elif ctx.sequence_parallel:
            local = torch.empty(
                (dgrad.shape[0] // dist.get_world_size(ctx.tp_group), dgrad.shape[1]),
                dtype=dgrad.dtype,
                device=dgrad.device,
            )
            handle = dist.reduce_scatter_tensor(local, dgrad, group=ctx.tp_group, async_op=True)
            dgrad = local
        elif ctx.allreduce_dgrad:
            handle = dist.all_reduce(dgrad, group=ctx.tp_group, async_op=True)
        # wgrad overlaps the dgrad communication, as in megatron.
        q_dyt = quantize_tiles(dy.t(), recipe.bwd_dtype, recipe.scales)
        x_t = _full_input_t(ctx, data, scale_inv)
        if isinstance(x_t, Quantized):
            wgrad = gemm(q_dyt, x_t)
        else:
            wgrad = dequantize(q_dyt, torch.float32) @ x_t.t()
        count_gemm("wgrad")
        grad_bias = dy.float().sum(0).to(grad_output.dtype) if ctx.use_bias else None
        if ctx.gtp:  # the shard reduce-scatters into main_grad; returns a dummy or None
            grad_weight = weight.wgrad_reduce_scatter(wgrad.to(weight.dtype))
        else:
            grad_weight = _route_wgrad(ctx, weight, wgrad)
        if handle is not None:
            handle.wait()
        if dgrad is not None:
            dgrad = dgrad.reshape(ctx.x_shape)
        return dgrad, grad_weight, grad_bias, *([None] * 6)


def _route_wgrad(ctx, weight: torch.Tensor, wgrad: torch.Tensor) -> torch.Tensor | None:
    """Return dW, or accumulate it into ``weight.main_grad`` the way megatron's fusion does."""
    if not (ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad")):
        return wgrad.to(weight.dtype)
    weight.main_grad.add_(wgrad.to(weight.main_grad.dtype))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # Megatron's DDP hooks expect a dummy gradient and this flag (layers.py, same contract).
    weight.grad_added_to_main_grad = True
    return torch.zeros(weight.main_grad.shape, dtype=ctx.x_dtype, device=wgrad.device)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: BlockwiseRecipe | None = None,
    *,
    sequence_parallel: bool = False,
    allreduce_dgrad: bool = False,
    tp_group=None,
    gradient_accumulation_fusion: bool = False,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with blockwise-FP8 forward, dgrad and wgrad (fp32 accumulation).

    :param x: ``[..., K]`` input (fp32/bf16/fp16); with ``sequence_parallel`` the local shard
        of the first dimension.
    :param weight: ``[N, K]``; its 128x128-block FP8 copy is reused within a step. With
        ``gtp_remat_size > 1`` a GTP-sharded weight (megatron 0.19) that gathers ``[N, K]``
        (see the module docstring); ``gradient_accumulation_fusion`` is then the shard's own.
    :param recipe: formats and scale rule (default: E4M3, power-of-two scales).
    """
    return BlockwiseFP8LinearFunction.apply(
        x,
        weight,
        bias,
        recipe or BlockwiseRecipe(),
        sequence_parallel,
        allreduce_dgrad,
        tp_group,
        gradient_accumulation_fusion,
        gtp_remat_size,
    )
