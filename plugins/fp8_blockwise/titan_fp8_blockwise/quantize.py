"""Blockwise FP8 quantization: 1x128 tiles (activations, gradients) and 128x128 blocks (weights).

The numbers follow TransformerEngine's reference definition of ``Float8BlockScaling``
(``tests/pytorch/references/quantize_scale_calc.py`` and ``blockwise_quantizer_reference.py``),
bit for bit, for every finite, infinite and NaN input:

* ``amax`` = max |x| over the tile, taken in the input dtype (exact), then as fp32.
* ``scale = fp8_max / amax`` in fp32; an infinite quotient (amax 0 or denormal) becomes
  ``finfo(x.dtype).max``.
* ``"pow2"`` (TE's default): ``scale`` is rounded down to a power of two the way the reference
  does it (``ldexp(1, frexp(scale).exponent - 1)``), so a NaN amax gives scale 0.5 and an
  infinite amax gives scale 0 (the CUDA kernel gives 1 for both; that is TE's only documented
  difference between kernel and reference).
* ``"fp32"`` (TE's ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``): the quotient as is.
* an all-zero tile gets scale 1; ``scale_inv = 1 / scale`` is what is stored; the data is
  ``clamp(x * scale, -fp8_max, fp8_max)`` cast with round-to-nearest-even.

``"deepseek"`` is DeepSeek-V3's own kernel (``inference/kernel.py``): ``scale_inv = amax / 448``
exactly (fp32) and ``q = x / scale_inv``; DeepSeek has no zero-tile guard (0/0 = NaN), we give an
all-zero tile ``scale_inv = 1`` like TE does.

Shapes that are not a multiple of 128 are zero padded up to the tile, which cannot change any
amax; the padding is cut off again, so data keeps the input shape and only the scale grid is
rounded up: ``[M, ceil(K/128)]`` for 1x128 tiles, ``[ceil(M/128), ceil(K/128)]`` for blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

TILE = 128
SCALE_MODES = ("pow2", "fp32", "deepseek")


@dataclass(frozen=True)
class Quantized:
    """An FP8 tensor with its dequantization scales.

    :param data: FP8 values, same 2-D shape as the source.
    :param scale_inv: fp32 dequantization factors, one per tile (compact layout).
    :param tile: (rows, cols) of one tile: (1, 128) or (128, 128).
    :param dtype: the high-precision dtype the data came from (restored by dequantize).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    tile: tuple[int, int]
    dtype: torch.dtype

    def nbytes(self) -> int:
        """Bytes held by data and scales together."""
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * 4


def scale_from_amax(
    amax: torch.Tensor, fp8_dtype: torch.dtype, x_dtype: torch.dtype, mode: str = "pow2"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (scale, scale_inv) in fp32 for fp32 per-tile ``amax`` (see the module docstring)."""
    if mode not in SCALE_MODES:
        raise ValueError(f"scale mode {mode!r} is not one of {SCALE_MODES}")
    fp8_max = torch.finfo(fp8_dtype).max
    if mode == "deepseek":
        scale_inv = amax / fp8_max
        scale_inv = torch.where(amax == 0, torch.ones_like(scale_inv), scale_inv)
        return torch.reciprocal(scale_inv), scale_inv
    # torch.div, not `fp8_max / amax`: the reflected operator is reciprocal-then-multiply
    # (two roundings) while the definition is one IEEE division.
    scale = torch.div(fp8_max, amax)
    scale = torch.where(torch.isinf(scale), torch.finfo(x_dtype).max, scale)
    if mode == "pow2":
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
        scale = torch.where(amax == float("inf"), torch.zeros_like(scale), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


def _to_fp8(
    tiles: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype, mode
) -> torch.Tensor:
    fp8_max = torch.finfo(fp8_dtype).max
    # bf16/fp16 tiles times an fp32 scale promote to fp32, exactly like the reference.
    scaled = tiles / scale_inv if mode == "deepseek" else tiles * scale
    return scaled.clamp_(-fp8_max, fp8_max).to(fp8_dtype)


def _check_2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"blockwise quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"blockwise quantization takes fp32/bf16/fp16 input, got {x.dtype}")


def quantize_tiles(
    x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, mode: str = "pow2"
) -> Quantized:
    """Quantize ``x [M, K]`` in 1x128 tiles along K (activations and gradients)."""
    _check_2d(x)
    rows, cols = x.shape
    padded = F.pad(x, (0, (-cols) % TILE)) if cols % TILE else x
    tiles = padded.reshape(rows, padded.shape[1] // TILE, TILE)  # explicit: rows may be 0
    amax = tiles.abs().amax(dim=-1).float()
    scale, scale_inv = scale_from_amax(amax, fp8_dtype, x.dtype, mode)
    data = _to_fp8(tiles, scale.unsqueeze(-1), scale_inv.unsqueeze(-1), fp8_dtype, mode)
    data = data.reshape(rows, padded.shape[1])[:, :cols].contiguous()
    return Quantized(data, scale_inv, (1, TILE), x.dtype)


def quantize_blocks(
    x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, mode: str = "pow2"
) -> Quantized:
    """Quantize ``x [M, K]`` in 128x128 blocks (weights)."""
    _check_2d(x)
    rows, cols = x.shape
    pad_r, pad_c = (-rows) % TILE, (-cols) % TILE
    padded = F.pad(x, (0, pad_c, 0, pad_r)) if pad_r or pad_c else x
    grid_r, grid_c = padded.shape[0] // TILE, padded.shape[1] // TILE
    tiles = padded.reshape(grid_r, TILE, grid_c, TILE)
    amax = tiles.abs().amax(dim=(1, 3)).float()
    scale, scale_inv = scale_from_amax(amax, fp8_dtype, x.dtype, mode)
    data = _to_fp8(tiles, scale[:, None, :, None], scale_inv[:, None, :, None], fp8_dtype, mode)
    data = data.reshape(grid_r * TILE, grid_c * TILE)[:rows, :cols].contiguous()
    return Quantized(data, scale_inv, (TILE, TILE), x.dtype)


def expand_scales(q: Quantized) -> torch.Tensor:
    """The per-element dequantization factor ``[M, K]`` of ``q`` (fp32)."""
    rows, cols = q.data.shape
    tile_r, tile_c = q.tile
    expanded = q.scale_inv.repeat_interleave(TILE, dim=1)[:, :cols]
    if tile_r > 1:
        expanded = expanded.repeat_interleave(tile_r, dim=0)[:rows]
    return expanded


def dequantize(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data * scale_inv`` computed in fp32, returned in ``dtype`` (default: the source dtype)."""
    rows, cols = q.data.shape
    tile_r, tile_c = q.tile
    if rows % tile_r == 0 and cols % tile_c == 0:
        # Broadcast over a tiled view: no materialised [M, K] scale tensor.
        view = q.data.reshape(rows // tile_r, tile_r, cols // tile_c, tile_c).float()
        out = (view * q.scale_inv.reshape(rows // tile_r, 1, cols // tile_c, 1)).reshape(rows, cols)
    else:
        out = q.data.float() * expand_scales(q)
    return out.to(dtype or q.dtype)
