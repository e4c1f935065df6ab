"""What differs per Megatron line (0.16-0.19) and must keep working on each.

* MoE + FP8 without TE: 0.16 ``get_te_version()`` is None (``is_te_min_version`` raises
  TypeError), 0.17+ it is ``0.0.0`` (Megatron refuses MoE FP8 with a ValueError). With the
  plugin the config builds on every line; without it Megatron's own refusal stands.
* 0.19 passes ``gtp_remat_size`` to the linear layers' ``_forward_impl``: a GTP-sharded weight
  (the shard, not the whole weight) must be gathered for the GEMM and its gradient handed back
  to the shard, through the patch record that serves 0.19.
"""

from __future__ import annotations

import pytest
import torch
from titan_fp8_blockwise import region
from titan_fp8_blockwise.linear import fp8_linear
from titan_fp8_blockwise.patches import patches
from titan_fp8_blockwise.recipe import BlockwiseRecipe

from titan_plugins.patching import gates

MOE_FP8 = {"fp8": "e4m3", "fp8_recipe": "blockwise"}


def _config_task(env) -> str:
    """Worker task: build the tiny MoE GPT's FP8 config (plugin active when ``env`` is a
    dict); return '' or the error as 'Type: message'."""
    import contextlib

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing.activation import plugin_active

    tiny_gpt.init_parallel()
    active = plugin_active("fp8_blockwise", env) if env is not None else contextlib.nullcontext()
    with active:
        try:
            cfg = tiny_gpt.make_config(**MOE_FP8)
        except Exception as err:
            return f"{type(err).__name__}: {err}"
    assert cfg.num_moe_experts and cfg.fp8 == "e4m3"
    return ""


def _megatron_line() -> str:
    version, _ = gates.resolve_version("megatron-core")
    return ".".join(version.split(".")[:2])


@pytest.mark.multiprocess
def test_fp8_lines_moe_fp8_config_builds_with_the_plugin_and_megatron_refuses_it_without(
    gloo_pool1,
):
    assert gloo_pool1.run(_config_task, {})[0] == ""
    refused = gloo_pool1.run(_config_task, None)[0]
    if _megatron_line() == "0.16":  # get_te_version() is None: the comparison itself fails
        assert refused.startswith("TypeError:") and "NoneType" in refused
    else:  # 0.17+: get_te_version() is 0.0.0 without TE
        assert refused == (
            "ValueError: Only transformer-engine>=1.7.0 supports MoE FP8 training, but your "
            "version is 0.0.0."
        )


class FakeGTPWeight(torch.nn.Parameter):
    """A stand-in for megatron 0.19's GTPShardedParam (which needs TE >= 2.19): holds rows
    ``rows`` of ``full`` and follows the protocol megatron's own linear function uses."""

    def configure(self, full: torch.Tensor, rows: slice) -> FakeGTPWeight:
        self.full, self.rows, self.calls = full, rows, []
        self.main_grad = torch.zeros_like(self.data)
        return self

    def all_gather_and_prefetch(self, fwd: bool = True) -> torch.Tensor:
        self.calls.append(("gather", fwd))
        return self.full.clone()  # a fresh buffer each time, like the pool's

    def all_gather_and_prefetch_bwd(self) -> torch.Tensor:
        self.calls.append(("gather_bwd",))
        return self.full.clone()

    def wgrad_reduce_scatter(self, wgrad: torch.Tensor) -> None:
        self.calls.append(("reduce_scatter", tuple(wgrad.shape)))
        self.main_grad.add_(wgrad[self.rows])  # one rank: the reduction is the identity
        return None  # the async case: autograd gets no gradient, main_grad has it


def _serving_0_19(target: str):
    """The patch record whose gate admits megatron-core 0.19.2 for ``target``."""
    found = [
        p
        for p in patches()
        if p.target.endswith(target) and not gates.judge_version(p.requires[0], "0.19.2").reason
    ]
    assert len(found) == 1, [p.id for p in patches() if p.target.endswith(target)]
    return found[0]


@pytest.mark.parametrize("cls", ["ColumnParallelLinear", "RowParallelLinear"])
def test_fp8_lines_0_19_forward_gathers_a_gtp_sharded_weight(cls):
    record = _serving_0_19(f"{cls}._forward_impl")
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(256, 384, generator=gen) * 0.05
    x = torch.randn(64, 384, generator=gen)
    dy = torch.randn(64, 256, generator=gen)
    shard = FakeGTPWeight(full[:128].clone()).configure(full, slice(0, 128))

    def megatron(*args, **kwargs):
        raise AssertionError("megatron's own path ran")

    layer = type("Layer", (), {"config": None, "is_expert": False})()
    keywords = dict(bias=None, gradient_accumulation_fusion=True, allreduce_dgrad=False)
    keywords |= dict(sequence_parallel=False, grad_output_buffer=None, tp_group=None)
    xg = x.clone().requires_grad_()
    with region.fp8_region(BlockwiseRecipe()):
        y = record.replace(megatron)(layer, input=xg, weight=shard, **keywords, gtp_remat_size=2)
    y.backward(dy)
    assert shard.calls == [("gather", True), ("gather_bwd",), ("reduce_scatter", (256, 384))]
    want_x, want_w = x.clone().requires_grad_(), full.clone().requires_grad_()
    want = fp8_linear(want_x, want_w)
    want.backward(dy)
    assert torch.equal(y, want)  # the whole weight, quantized as the unsharded layer does
    assert torch.equal(xg.grad, want_x.grad)
    assert torch.equal(shard.main_grad, want_w.grad[:128])
    assert shard.grad is None
