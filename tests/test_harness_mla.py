"""Multi-latent attention on CPU (issue 44 item 1): the harness' core attention for MLA computes
attention as the formula does, and a Kimi-K2-shaped megatron-core model (MLA, a dense first
layer, a shared expert, a sigmoid router with expert bias and group-limited routing, RMSNorm,
SwiGLU) builds from megatron's own specs and trains on CPU through megatron's schedules, at
world size 1 and at EP=2 and PP=2 from the same initial weights.

Before: megatron-core's local MLA spec hands ``k_channels`` to the local ``DotProductAttention``,
which does not take it (every served line), and on 0.16.1 every MLA layer also failed on
``isinstance(linear_proj, TELinear)`` with TE absent: no MLA model could be built on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from titan_plugins.hosts.megatron.testing import tiny_gpt

pytestmark = pytest.mark.multiprocess

STEPS = 5
KIMI_MODEL = tiny_gpt.MODELS["kimi"].gpt_kwargs


def core_attention_against_the_formula() -> dict:
    """MLACoreAttention as MLA builds it, on random inputs, against softmax(q k^T s + causal) v."""
    from megatron.core.transformer.enums import AttnMaskType

    from titan_plugins.hosts.megatron.testing.mla_attention import MLACoreAttention

    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_kimi_config()
    heads, q_dim, v_dim, scale = 4, 24, 12, 0.3
    attention = MLACoreAttention(
        config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
        attention_type="self", softmax_scale=scale, k_channels=q_dim, v_channels=v_dim,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    sq, b = 8, 2
    query = torch.randn(sq, b, heads, q_dim, generator=generator)
    key = torch.randn(sq, b, heads, q_dim, generator=generator)
    value = torch.randn(sq, b, heads, v_dim, generator=generator)
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    out = attention(query, key, value, causal.view(1, 1, sq, sq))
    # the formula, in float64: [b, heads, sq, sk]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(causal, float("-inf"))
    expected = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(sq, b, heads * v_dim)
    return {"shape": tuple(out.shape), "max_error": (out.double() - expected).abs().max().item()}


def test_the_demo_offers_the_model_shapes_tiny_gpt_has() -> None:
    from titan_entrypoints import cpu_demo

    assert cpu_demo.MODELS == tuple(tiny_gpt.MODELS)


def test_the_mla_core_attention_computes_the_attention_formula(gloo_pool1) -> None:
    (found,) = gloo_pool1.run(core_attention_against_the_formula)
    # the output is as wide as the value heads (4 x 12), not heads x kv_channels (4 x 16)
    assert found["shape"] == (8, 2, 48)
    # fp32 against fp64: rounding only (a wrong scale, mask or head size is off by > 1e-2)
    assert found["max_error"] < 1e-5


def what_the_kimi_model_is() -> dict:
    """The layer types and router settings megatron built from the Kimi-shaped config."""
    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_kimi_config()
    (model,) = tiny_gpt.build_model(cfg, ddp=False, **KIMI_MODEL)
    layers = list(model.decoder.layers)
    moe = layers[1].mlp
    return {
        "attention": [type(layer.self_attention).__name__ for layer in layers],
        "core_attention": type(layers[0].self_attention.core_attention).__name__,
        "mlp": [type(layer.mlp).__name__ for layer in layers],
        "shared_expert": type(getattr(moe, "shared_experts", None)).__name__,
        "score_function": moe.router.score_function,
        "expert_bias": tuple(moe.router.expert_bias.shape),
        "groups": (
            moe.router.config.moe_router_num_groups,
            moe.router.config.moe_router_group_topk,
        ),
        "norm": type(layers[0].input_layernorm).__name__,
        "gated": cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu,
        "tied_output": model.share_embeddings_and_output_weights,
    }


def test_the_kimi_shaped_model_is_built_from_megatrons_own_modules(gloo_pool1) -> None:
    (found,) = gloo_pool1.run(what_the_kimi_model_is)
    assert found["attention"] == ["MLASelfAttention"] * 4
    assert found["core_attention"] == "MLACoreAttention"
    assert found["mlp"] == ["MLP", "MoELayer", "MoELayer", "MoELayer"]  # the first layer dense
    assert found["shared_expert"] == "SharedExpertMLP"
    assert (found["score_function"], found["expert_bias"], found["groups"]) == (
        "sigmoid",
        (4,),
        (2, 1),
    )
    assert found["norm"] in ("RMSNorm", "WrappedTorchNorm", "FusedLayerNorm") and found["gated"]
    assert found["tied_output"] is False


def kimi_reference_run(steps: int) -> tuple:
    """World size 1: initial weights, losses, grad norms, and each router's expert bias."""
    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_kimi_config()
    chunks = tiny_gpt.build_model(cfg, **KIMI_MODEL)
    initial = tiny_gpt.global_state_dict(chunks)
    losses, grad_norms = tiny_gpt.train(chunks, cfg, steps)
    return initial, losses, grad_norms, _expert_biases(chunks)


def kimi_layout_run(initial: dict, steps: int, parallel: dict) -> tuple:
    """Another layout, from the reference's initial weights."""
    tiny_gpt.init_parallel(**parallel)
    cfg = tiny_gpt.make_kimi_config()
    chunks = tiny_gpt.build_model(cfg, ddp=False, **KIMI_MODEL)
    tiny_gpt.load_global_state_dict(chunks, initial)
    chunks = tiny_gpt.wrap_ddp(chunks, cfg)
    losses, grad_norms = tiny_gpt.train(chunks, cfg, steps)
    return losses, grad_norms


def _expert_biases(chunks: list) -> list[list[float]]:
    """Each MoE router's expert bias (the aux-loss-free balancing state megatron updates)."""
    return [
        module.expert_bias.tolist()
        for chunk in chunks
        for name, module in chunk.named_modules()
        if name.endswith("router") and getattr(module, "expert_bias", None) is not None
    ]


@pytest.fixture(scope="module")
def kimi_reference(gloo_pool1) -> tuple:
    return gloo_pool1.run(kimi_reference_run, STEPS)[0]


def test_the_kimi_shaped_model_trains_on_cpu(kimi_reference) -> None:
    _, losses, grad_norms, biases = kimi_reference
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses + grad_norms)
    # the same batches every step: the loss falls at every step
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    # the 3 MoE layers have an expert bias, and megatron's aux-loss-free update moved it (it
    # starts at zero and moves by the rate per step where the load is uneven; a layer whose
    # experts got equal loads keeps zeros)
    assert len(biases) == 3 and any(b != 0.0 for bias in biases for b in bias)


@pytest.mark.parametrize("parallel", [{"ep": 2}, {"pp": 2}], ids=["ep2", "pp2"])
def test_the_kimi_shaped_model_trains_alike_at_ep2_and_pp2(gloo_pool2, kimi_reference, parallel) -> None:  # fmt: skip
    initial, ref_losses, ref_norms, _ = kimi_reference
    results = gloo_pool2.run(kimi_layout_run, initial, STEPS, parallel)
    losses = results[-1][0]  # the last stage reports the loss (every rank at EP=2)
    # a layout changes the order of sums only (the expert-gradient scaling, the grad-norm
    # all-reduce), as in test_harness_training's GPT comparisons
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    for _, grad_norms in results:
        torch.testing.assert_close(grad_norms, ref_norms, rtol=1e-5, atol=0)
