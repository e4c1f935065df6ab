"""Kernel selection of the blockwise GEMM: a ``torch._scaled_mm`` scale layout is used only after
it reproduced the emulation. CPU torch has no block-scaled FP8 GEMM, so the kernel is a fake with
cuBLAS semantics that accepts exactly one stride layout of the scale tensors."""

from __future__ import annotations

import pytest
import torch
from titan_fp8_blockwise import gemm as gemm_mod
from titan_fp8_blockwise.quantize import quantize_blocks, quantize_tiles

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _fake_scaled_mm(accepts: int, calls: list):
    """Block-scaled ``a @ b`` that understands only layout ``accepts`` of ``gemm._LAYOUTS``."""
    a_col_major, b_row_major = accepts in (0, 1), accepts in (0, 2)

    def col_major(s):  # strides of size-1 dimensions do not matter
        return s.shape[0] == 1 or s.stride(0) == 1

    def row_major(s):
        return s.shape[1] == 1 or s.stride(1) == 1

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        ok_a = col_major(scale_a) if a_col_major else row_major(scale_a)
        ok_b = row_major(scale_b) if b_row_major else col_major(scale_b)
        if not (ok_a and ok_b):
            raise RuntimeError("Invalid scaling configuration")
        calls.append(accepts)
        sa = scale_a.repeat_interleave(128, 1)[:, : a.shape[1]]
        sb = scale_b.repeat_interleave(128, 0)[: b.shape[0]]
        if scale_b.shape[1] != b.shape[1]:  # 128x128 blocks: expand along N too
            sb = sb.repeat_interleave(128, 1)[:, : b.shape[1]]
        return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)

    return scaled_mm


@pytest.mark.parametrize("accepts", [0, 1, 2])
@pytest.mark.parametrize("blocks", [True, False], ids=["w128x128", "wgrad1x128"])
def test_fp8_gemm_uses_only_a_verified_layout(monkeypatch, accepts, blocks):
    calls: list[int] = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(accepts, calls), raising=False)
    monkeypatch.setattr(gemm_mod, "_kernel_device", lambda device: True)
    monkeypatch.setattr(gemm_mod, "_VERIFIED", {})
    qx = quantize_tiles(torch.randn(64, 256))
    w = torch.randn(128, 256)
    qw = quantize_blocks(w) if blocks else quantize_tiles(w)
    y = gemm_mod.gemm(qx, qw)
    assert gemm_mod._VERIFIED == {(0, qw.tile): accepts}
    assert calls and set(calls) == {accepts}  # verification and the real call
    assert torch.allclose(y, gemm_mod.gemm_emulated(qx, qw), rtol=1e-5, atol=1e-5)


def test_fp8_gemm_falls_back_when_no_layout_verifies(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(torch, "_scaled_mm", broken, raising=False)
    monkeypatch.setattr(gemm_mod, "_kernel_device", lambda device: True)
    monkeypatch.setattr(gemm_mod, "_VERIFIED", {})
    qx, qw = quantize_tiles(torch.randn(64, 256)), quantize_blocks(torch.randn(128, 256))
    assert torch.equal(gemm_mod.gemm(qx, qw), gemm_mod.gemm_emulated(qx, qw))
    assert gemm_mod._VERIFIED == {(0, (128, 128)): -1}


def test_fp8_gemm_shape_rules():
    qx, qw = quantize_tiles(torch.randn(64, 200)), quantize_blocks(torch.randn(128, 200))
    assert not gemm_mod._kernel_shape_ok(qx, qw)  # K not in whole tiles: emulated
    assert not gemm_mod._kernel_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm_mod.gemm(qx, quantize_blocks(torch.randn(128, 256)))
