"""The saved-activation contract (``titan_plugins.saved_tensors``) between a plugin that saves
tensors without a ``grad_fn`` (fp8_blockwise's FP8 input copies and scales) and one that moves
saved activations (act_offload), on plain torch: no megatron, one process.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
import torch

from titan_plugins.saved_tensors import is_activation, mark_activation

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

INSTALLED = {ep.name for ep in metadata.entry_points(group="titan_plugins")}
both = pytest.mark.skipif(
    not {"act_offload", "fp8_blockwise"} <= INSTALLED,
    reason="needs titan-act-offload and titan-fp8-blockwise installed",
)


def test_saved_tensors_contract_marks_the_object():
    made = torch.ones(3)
    assert not is_activation(made)  # no grad_fn, not marked: a constant as far as anyone knows
    assert mark_activation(made) is made and is_activation(made)
    assert not is_activation(made.view(3))  # the mark is the object's, not its storage's
    assert is_activation(torch.ones(2, requires_grad=True) * 2)  # a grad_fn says it already
    assert mark_activation(None) is None


def test_saved_tensors_module_imports_nothing():
    code = "import sys, titan_plugins.saved_tensors\nassert 'torch' not in sys.modules\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _recipe():
    from titan_fp8_blockwise.recipe import BlockwiseRecipe

    return BlockwiseRecipe()


@both
def test_act_offload_moves_fp8_copies_and_scales_bit_exactly():
    from titan_act_offload.offloader import Offloader
    from titan_act_offload.settings import OffloadSettings
    from titan_fp8_blockwise.linear import fp8_linear
    from titan_fp8_blockwise.swiglu_store import stored_swiglu

    from titan_plugins import platform

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(64, 256, generator=gen, dtype=torch.bfloat16)
    w1 = torch.randn(512, 256, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w2 = torch.randn(256, 256, generator=gen, dtype=torch.bfloat16).requires_grad_()

    def run(offloader):
        from titan_act_offload.plan import Unit

        x = x0.clone().requires_grad_()
        if offloader is not None:
            state = offloader.begin_unit(Unit(0, 0), True, frozenset())
            block = offloader.enter_block("mlp")
        out = fp8_linear(stored_swiglu(fp8_linear(x * 1.0, w1), None, None, _recipe()), w2)
        if offloader is not None:
            offloader.exit_block(block)
            offloader.end_unit_forward(state)
            offloader.prefetch_unit(state)
        out.float().square().sum().backward()
        grads = [x.grad, w1.grad.clone(), w2.grad.clone()]
        w1.grad = w2.grad = None
        return grads

    reference = run(None)
    offloader = Offloader(OffloadSettings(min_bytes=0), platform)
    offloader.param_storages = frozenset(w.untyped_storage().data_ptr() for w in (w1, w2))
    assert all(torch.equal(a, b) for a, b in zip(reference, run(offloader), strict=True))
    stats = offloader.stats
    # Saved: fc1's input (FP8 [256 x 64] + fp32 scales [256 x 1]), the SwiGLU input (FP8
    # [64 x 512] + scales [64 x 4]) and fc2's input (FP8 [256 x 64] + scales [256 x 1]).
    fp8 = 256 * 64 + 64 * 512 + 256 * 64
    scales = 4 * (256 + 64 * 4 + 256)
    assert stats.offloaded_bytes == stats.prefetched_bytes == fp8 + scales
    assert "leaf" not in stats.skipped and stats.late_reloads == 0
    assert stats.resident == 0 and stats.live == 0 and offloader.pool.in_use == 0
