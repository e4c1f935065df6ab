"""The blockwise-FP8 linear against fp64 references.

Two kinds of check:

* structure (tight): every GEMM equals the fp64 product of the operands *as the recipe quantizes
  them* (x 1x128 along K, W 128x128 blocks, dy 1x128 along N for dgrad, dy and x 1x128 along
  tokens for wgrad) up to fp32 accumulation error (< 1e-6 relative). A wrong tiling, a transposed
  scale grid or a missing quantization breaks this by orders of magnitude.
* accuracy (measured): relative Frobenius error against the unquantized fp64 math. E4M3 keeps 3
  mantissa bits: RNE gives a per-element relative error of RMS 2^-4/sqrt(12)*sqrt(E[1/m^2]) =
  0.0255 for mantissas m uniform in [1, 2); a product of two quantized operands doubles the
  variance: 0.036. Measured over 5 seeds x 3 shapes x fp32/bf16: fprop (with bias) 0.024-0.033,
  dgrad/wgrad 0.035-0.038. E5M2 gradients (``fp8="hybrid"``): theory 0.057, measured 0.058-0.060.
  Bounds: E4M3 <= 0.045, E5M2 <= 0.07, and >= 0.02 so that an unquantized path (bf16 gives
  0.003) fails.
"""

from __future__ import annotations

import pytest
import torch
from titan_fp8_blockwise import weight_cache
from titan_fp8_blockwise.linear import fp8_linear
from titan_fp8_blockwise.quantize import dequantize, quantize_blocks, quantize_tiles
from titan_fp8_blockwise.recipe import BlockwiseRecipe

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _run(m: int, k: int, n: int, dtype: torch.dtype, recipe: BlockwiseRecipe, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).requires_grad_()
    b = torch.randn(n, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to(dtype)
    y = fp8_linear(x, w, b, recipe)
    y.backward(dy)
    return x, w, b, dy, y


def _dq64(q) -> torch.Tensor:
    return dequantize(q, torch.float32).double()


SHAPES = [(256, 384, 256), (200, 300, 260)]  # tile-aligned, and padded in every dimension


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", [BlockwiseRecipe(), BlockwiseRecipe(bwd_dtype=E5M2)])
def test_fp8_linear_gemms_use_the_blockwise_operands(m, k, n, dtype, recipe):
    x, w, b, dy, y = _run(m, k, n, dtype, recipe)
    xd, wd, dyd = x.detach(), w.detach(), dy
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    y_ref = _dq64(quantize_tiles(xd, fwd)) @ _dq64(quantize_blocks(wd, fwd)).t()
    y_ref = (y_ref.float() + b.detach().float()).to(dtype)
    dx_ref = _dq64(quantize_tiles(dyd, bwd)) @ _dq64(quantize_blocks(wd, fwd))
    dw_ref = _dq64(quantize_tiles(dyd.t(), bwd)) @ _dq64(quantize_tiles(xd.t(), fwd)).t()
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: the output cast alone
    assert _rel(y, y_ref.double()) < tol
    assert _rel(x.grad, dx_ref) < tol
    assert _rel(w.grad, dw_ref) < tol
    assert torch.equal(b.grad, dy.float().sum(0).to(dtype))


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize(
    "dtype,bwd,bound,scales",
    [
        (torch.float32, E4M3, 0.045, "pow2"),
        (torch.bfloat16, E4M3, 0.045, "pow2"),
        (torch.bfloat16, E5M2, 0.07, "pow2"),
        (torch.float32, E4M3, 0.045, "deepseek"),
    ],
    ids=["fp32-e4m3", "bf16-e4m3", "bf16-hybrid", "fp32-deepseek"],
)
def test_fp8_linear_error_vs_fp64_is_bounded(m, k, n, dtype, bwd, bound, scales):
    x, w, b, dy, y = _run(m, k, n, dtype, BlockwiseRecipe(bwd_dtype=bwd, scales=scales), seed=1)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    assert 0.02 < _rel(y, x64 @ w64.t() + b.detach().double()) < 0.045
    assert 0.02 < _rel(x.grad, dy64 @ w64) < bound
    assert 0.02 < _rel(w.grad, dy64.t() @ x64) < bound


def test_fp8_linear_saves_fp8_input_not_high_precision():
    x = torch.randn(512, 1024, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 1024, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fp8_linear(x, w)
    assert {t.dtype for t in saved} == {E4M3, torch.float32}
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    bf16_bytes = x.numel() * 2
    assert nbytes / bf16_bytes <= 0.55  # 1 byte + 4 bytes per 128 elements = 0.516
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None


def test_fp8_linear_weight_quantized_once_per_step_and_version():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(8, 256)
    weight_cache.next_step()
    before = weight_cache.stats()
    for _ in range(3):  # three microbatches, forward and backward
        fp8_linear(x, w).sum().backward()
    after = weight_cache.stats()
    assert after["misses"] - before["misses"] == 1
    assert after["hits"] - before["hits"] == 2
    with torch.no_grad():
        w.add_(1.0)  # an optimizer-style in-place update bumps the version
    fp8_linear(x, w)
    assert weight_cache.stats()["misses"] - after["misses"] == 1
    weight_cache.next_step()  # a new step invalidates even without a version bump
    fp8_linear(x, w)
    assert weight_cache.stats()["misses"] - after["misses"] == 2
    # and the result after the update uses the updated weight
    want = _dq64(quantize_tiles(x)) @ _dq64(quantize_blocks(w.detach())).t()
    assert _rel(fp8_linear(x, w), want) < 1e-6


def test_fp8_linear_three_dim_input_and_no_bias():
    x = torch.randn(16, 2, 384, requires_grad=True)  # megatron's [seq, batch, hidden]
    w = torch.randn(128, 384, requires_grad=True)
    y = fp8_linear(x, w)
    assert y.shape == (16, 2, 128)
    y2 = fp8_linear(x.detach().reshape(32, 384), w)
    assert torch.equal(y.reshape(32, 128), y2)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_fp8_linear_zero_tokens():
    # An MoE expert can receive no tokens in a step.
    x = torch.zeros(0, 256, requires_grad=True)
    w = torch.randn(128, 256, requires_grad=True)
    y = fp8_linear(x, w)
    y.sum().backward()
    assert y.shape == (0, 128) and torch.equal(w.grad, torch.zeros_like(w))


def test_fp8_linear_gradient_accumulation_fusion_adds_into_main_grad():
    # megatron's contract: dW accumulates into weight.main_grad (fp32); DDP's hooks get a dummy
    # gradient and the grad_added_to_main_grad flag.
    x = torch.randn(64, 256)
    w = torch.randn(128, 256, requires_grad=True)
    want = torch.randn(128, 256)
    fp8_linear(x, w).sum().backward()
    dw = w.grad.clone()
    w.grad = None
    w.main_grad = want.clone()
    w.grad_added_to_main_grad = False
    fp8_linear(x, w, gradient_accumulation_fusion=True).sum().backward()
    assert torch.equal(w.main_grad, want + dw)
    assert w.grad_added_to_main_grad is True and torch.equal(w.grad, torch.zeros_like(w))
