"""The quantizer against an element-by-element reference written from TE's definition.

The reference below does not use torch for any arithmetic: fp32 division/multiplication come from
numpy scalars (IEEE fp32), the power-of-two floor from ``math.frexp`` (as TE's reference does
with ``torch.frexp``), and FP8 rounding from an explicit table of every E4M3 / E5M2 value with
round-to-nearest-even tie breaking. Tiles, padding and the special cases (zero tile, denormal or
infinite amax, NaN) are all walked by hand, so a tiling or broadcasting mistake cannot hide.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch
from titan_fp8_blockwise.quantize import dequantize, quantize_blocks, quantize_tiles

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {E4M3: (4, 3, 7, 448.0), E5M2: (5, 2, 15, 57344.0)}  # exponent bits, mantissa bits, bias


def _fp8_grid(dtype: torch.dtype) -> list[tuple[float, int]]:
    """Every finite non-negative value of the format with its code (for the even-tie rule)."""
    ebits, mbits, bias, fmax = FMT[dtype]
    out = []
    for code in range(1 << (ebits + mbits)):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if e == 0:
            value = m * 2.0 ** (1 - bias - mbits)
        else:
            value = (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
        if value <= fmax:
            out.append((value, code))
    return out


GRID = {dt: _fp8_grid(dt) for dt in FMT}
GRID_VALUES = {dt: [v for v, _ in grid] for dt, grid in GRID.items()}


def _round_fp8(v: float, dtype: torch.dtype) -> float:
    """Round-to-nearest-even onto the FP8 grid (input already clamped to +-max)."""
    if math.isnan(v):
        return v
    mag, grid = abs(v), GRID[dtype]
    hi = bisect.bisect_left(GRID_VALUES[dtype], mag)  # grid[hi-1] < mag <= grid[hi]
    near = grid[max(hi - 1, 0) : hi + 1]
    best = min(near, key=lambda vc: (abs(vc[0] - mag), vc[1] & 1))
    return math.copysign(best[0], v)


def _ref_scale(amax: float, dtype: torch.dtype, x_max: float, mode: str) -> tuple[float, float]:
    f32 = np.float32
    fmax = f32(FMT[dtype][3])
    with np.errstate(all="ignore"):
        if mode == "deepseek":
            sinv = f32(1.0) if amax == 0 else f32(amax) / fmax
            return float(f32(1.0) / sinv), float(sinv)
        scale = fmax / f32(amax)
        if math.isinf(scale):
            scale = f32(x_max)
        if mode == "pow2":
            scale = f32(2.0 ** (math.frexp(float(scale))[1] - 1))
            if amax == math.inf:
                scale = f32(0.0)
        if amax == 0:
            scale = f32(1.0)
        return float(scale), float(f32(1.0) / scale)


def _ref_quantize(x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype, mode: str):
    """Element-wise reference: returns (fp8 values as float64 array, scale_inv array)."""
    vals = x.float().tolist()
    rows, cols = len(vals), len(vals[0])
    tr, tc = tile
    gr, gc = -(-rows // tr), -(-cols // tc)
    fmax = FMT[dtype][3]
    x_max = torch.finfo(x.dtype).max
    q = np.zeros((rows, cols))
    sinv_grid = np.zeros((gr, gc), dtype=np.float32)
    for bi in range(gr):
        for bj in range(gc):
            cells = [
                (i, j)
                for i in range(bi * tr, min((bi + 1) * tr, rows))
                for j in range(bj * tc, min((bj + 1) * tc, cols))
            ]
            mags = [abs(vals[i][j]) for i, j in cells]
            amax = math.nan if any(math.isnan(m) for m in mags) else max(mags)
            scale, sinv = _ref_scale(amax, dtype, x_max, mode)
            sinv_grid[bi, bj] = sinv
            for i, j in cells:
                with np.errstate(all="ignore"):
                    if mode == "deepseek":
                        s = float(np.float32(vals[i][j]) / np.float32(sinv))
                    else:
                        s = float(np.float32(vals[i][j]) * np.float32(scale))
                s = s if math.isnan(s) else min(max(s, -fmax), fmax)
                q[i, j] = _round_fp8(s, dtype)
    return q, sinv_grid


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 4, cols)  # wide range
    x = x.to(dtype)
    x[: min(rows, 2), : min(cols, 128)] = 0  # all-zero 1x128 tiles
    if rows > 128 and cols > 128:
        x[128:, 128:256] = 0  # an all-zero 128x128 block
    return x


CASES = [
    ((3, 300), (1, 128)),
    ((5, 128), (1, 128)),
    ((130, 260), (128, 128)),
    ((128, 72), (128, 128)),
]


@pytest.mark.parametrize("mode", ["pow2", "fp32", "deepseek"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,tile", CASES, ids=lambda c: "x".join(map(str, c)))
def test_fp8_quantize_matches_reference_bitwise(shape, tile, xdtype, fp8, mode):
    x = _inputs(*shape, xdtype, seed=shape[0] * 1000 + shape[1])
    qfn = quantize_tiles if tile == (1, 128) else quantize_blocks
    q = qfn(x, fp8, mode)
    ref_q, ref_sinv = _ref_quantize(x, tile, fp8, mode)
    assert q.data.shape == x.shape and q.data.dtype == fp8
    assert q.scale_inv.dtype == torch.float32
    assert np.array_equal(q.scale_inv.numpy().view(np.int32), ref_sinv.view(np.int32))
    assert np.array_equal(q.data.double().numpy(), ref_q)
    # dequantize is data * scale_inv in fp32, per tile
    expect = (
        torch.from_numpy(ref_q).float()
        * torch.from_numpy(ref_sinv)
        .repeat_interleave(tile[0], 0)
        .repeat_interleave(128, 1)[: shape[0], : shape[1]]
    )
    assert torch.equal(dequantize(q, torch.float32), expect)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["pow2", "fp32", "deepseek"])
def test_fp8_quantize_special_values_match_reference(xdtype, mode):
    tiny = 1e-40 if xdtype == torch.float32 else 1e-38  # denormal / near-denormal amax
    rows = [
        [0.0] * 128,
        [tiny] * 128,
        [torch.finfo(xdtype).max] * 128,
        [-torch.finfo(xdtype).max] + [1.0] * 127,
        [math.inf] + [1.0] * 127,
        [math.nan] + [2.0] * 127,
        [3.0] + [0.0] * 127,
    ]
    x = torch.tensor(rows, dtype=xdtype)
    q = quantize_tiles(x, E4M3, mode)
    ref_q, ref_sinv = _ref_quantize(x, (1, 128), E4M3, mode)
    assert np.array_equal(q.scale_inv.numpy().view(np.int32), ref_sinv.view(np.int32))
    assert np.array_equal(q.data.double().numpy(), ref_q, equal_nan=True)


def test_fp8_quantize_hand_derived_pow2_values():
    # amax 3: 448/3 = 149.33 -> floor to 128 -> scale_inv 2^-7, q = 3 * 128 = 384
    q = quantize_tiles(torch.tensor([[3.0] + [0.0] * 127]))
    assert q.scale_inv.item() == 2.0**-7 and q.data.float()[0, 0].item() == 384.0
    # all-zero tile -> scale 1; fp32-max tile -> 448/3.4e38 floored = 2^-120
    q = quantize_tiles(torch.tensor([[0.0] * 128, [torch.finfo(torch.float32).max] * 128]))
    assert q.scale_inv.tolist() == [[1.0], [2.0**120]]
    # denormal amax: 448/1e-40 overflows -> finfo(fp32).max -> 2^127 -> scale_inv 2^-127
    q = quantize_tiles(torch.full((1, 128), 1e-40))
    assert q.scale_inv.item() == 2.0**-127
    # inf in a tile: the reference's scale 0 -> scale_inv inf, finite values become 0
    q = quantize_tiles(torch.tensor([[math.inf, 5.0] + [0.0] * 126]))
    assert q.scale_inv.item() == math.inf and q.data.float()[0, 1].item() == 0.0
    # DeepSeek: scale_inv = amax / 448 exactly, q = x / scale_inv
    q = quantize_tiles(torch.tensor([[3.0] + [0.0] * 127]), mode="deepseek")
    assert q.scale_inv.item() == np.float32(3.0) / np.float32(448.0)
    assert q.data.float()[0, 0].item() == 448.0


def test_fp8_quantize_padding_is_invisible():
    # A non-multiple-of-128 tensor quantizes exactly like its zero-padded version, cut back.
    x = torch.randn(200, 300)
    padded = torch.nn.functional.pad(x, (0, 84, 0, 56))
    for fn in (quantize_tiles, quantize_blocks):
        q, qp = fn(x), fn(padded)
        assert torch.equal(q.data.view(torch.uint8), qp.data[:200, :300].view(torch.uint8))
        assert torch.equal(q.scale_inv, qp.scale_inv[: q.scale_inv.shape[0]])


def test_fp8_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        quantize_tiles(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        quantize_blocks(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale mode"):
        quantize_tiles(torch.zeros(2, 128), mode="pow3")
