"""Blockwise-scaled FP8 GEMM ``y = a @ b.T`` with fp32 accumulation.

``a`` is always 1x128-tiled along K; ``b`` is either 128x128 blocks (a weight) or 1x128 tiles
along K (the wgrad GEMM, where both operands are tiled along the token dimension).

* CPU (and any device without a verified kernel): dequantize both operands to fp32 and run one
  fp32 matmul. With power-of-two scales the dequantization is exact, so this equals the
  DeepSeek-V3 / TE "split accumulator" (fp32 partial sums per 128-wide K block, scaled, added)
  up to the fp32 rounding of the partial sums (measured: 2.8e-7 of max|y| at 4096^3).
* CUDA: ``torch._scaled_mm`` with block scales where this torch and GPU accept them. The layout
  cuBLAS expects for block scales has changed between torch releases, so the first call per
  device and operand kind tries the known layouts on a small random problem and keeps the first
  one whose result matches the emulation; if none does, that kind stays on the emulated path.
"""

from __future__ import annotations

import torch

from titan_fp8_blockwise.quantize import TILE, Quantized, dequantize

# (device index, b tile) -> index into _LAYOUTS, or -1 when no layout was verified.
_VERIFIED: dict[tuple[int, tuple[int, int]], int] = {}


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """Same values, column-major strides (cuBLAS wants the tile index of M fastest)."""
    return s.t().contiguous().t()


# Candidate (scale_a, scale_b) layouts for torch._scaled_mm(a [M,K], b.T [K,N] col-major).
_LAYOUTS = (
    lambda a, b: (_outer_major(a.scale_inv), _outer_major(b.scale_inv).t()),
    lambda a, b: (_outer_major(a.scale_inv), b.scale_inv.t()),
    lambda a, b: (a.scale_inv, b.scale_inv.t().contiguous()),
)


def gemm_emulated(a: Quantized, b: Quantized) -> torch.Tensor:
    """Reference path: dequantize to fp32 and multiply (fp32 result)."""
    return dequantize(a, torch.float32) @ dequantize(b, torch.float32).t()


def _scaled_mm(a: Quantized, b: Quantized, layout: int) -> torch.Tensor:
    scale_a, scale_b = _LAYOUTS[layout](a, b)
    return torch._scaled_mm(
        a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32
    )


def _kernel_shape_ok(a: Quantized, b: Quantized) -> bool:
    # cuBLAS block scaling: K in whole 128 tiles, M and N aligned to 16.
    m, k = a.data.shape
    n = b.data.shape[0]
    return k % TILE == 0 and m % 16 == 0 and n % 16 == 0


def _kernel_device(device: torch.device) -> bool:
    """Only CUDA has a block-scaled FP8 GEMM (CPU ``_scaled_mm`` rejects block scales)."""
    return device.type == "cuda" and hasattr(torch, "_scaled_mm")


def _verify_layout(device: torch.device, b_tile: tuple[int, int]) -> int:
    from titan_fp8_blockwise.quantize import quantize_blocks, quantize_tiles

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 384, device=device, generator=gen)
    w = torch.randn(256, 384, device=device, generator=gen)
    qa = quantize_tiles(x)
    qb = quantize_blocks(w) if b_tile == (TILE, TILE) else quantize_tiles(w)
    want = gemm_emulated(qa, qb)
    for index in range(len(_LAYOUTS)):
        try:
            got = _scaled_mm(qa, qb, index)
        except (RuntimeError, ValueError, TypeError):
            continue
        if torch.allclose(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item()):
            return index
    return -1


def kernel_layout(a: Quantized, b: Quantized) -> int:
    """Index of the verified ``_scaled_mm`` scale layout for these operands, or -1."""
    device = a.data.device
    if not _kernel_device(device) or not _kernel_shape_ok(a, b):
        return -1
    key = (device.index or 0, b.tile)
    if key not in _VERIFIED:
        _VERIFIED[key] = _verify_layout(device, b.tile)
    return _VERIFIED[key]


def gemm(a: Quantized, b: Quantized) -> torch.Tensor:
    """``a @ b.T`` in fp32 from blockwise-quantized operands (see the module docstring)."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"inner dimensions differ: {a.data.shape} vs {b.data.shape}")
    layout = kernel_layout(a, b)
    if layout >= 0:
        return _scaled_mm(a, b, layout)
    return gemm_emulated(a, b)
