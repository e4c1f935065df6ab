"""The trainer's export: Megatron shards -> the whole model's Hugging Face weights on rank 0,
the same tensors bit for bit under TP=2 and PP=2 as at world size 1 (the gather only moves and
splits bytes), and names refused by name where there is no Hugging Face name."""

from __future__ import annotations

import pytest
import torch
from titan_weight_sync import tiny_llama
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.megatron_export import gather_hf_weights, hf_names

from titan_plugins.hosts.megatron.testing import tiny_gpt


def export_task(layout: dict, state: dict | None = None, moe: bool = False) -> tuple[dict, dict]:
    """Build the tiny Llama-style model in ``layout``, load ``state`` (megatron global names:
    the pipeline stages draw other initial weights than world size 1) and gather its Hugging
    Face weights; also returns this rank's megatron state."""
    tiny_gpt.init_parallel(**layout)
    cfg = tiny_llama.make_config(num_moe_experts=4 if moe else None)
    chunks = tiny_llama.build(cfg)
    if state is not None:
        tiny_gpt.load_global_state_dict(chunks, state)
    return gather_hf_weights(chunks, cfg), tiny_gpt.global_state_dict(chunks)


@pytest.mark.multiprocess
def test_tp2_and_pp2_gather_the_same_weights_as_world_size_1(gloo_pool1, gloo_pool2) -> None:
    ((reference, state),) = gloo_pool1.run(export_task, {})
    assert len(reference) == 21  # embed, norm, lm_head, 9 per layer
    assert reference["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # 2 KV heads
    # TP=2 draws the same initial weights and splits them; PP=2 gets world size 1's loaded
    for layout, given in (({"tp": 2}, None), ({"pp": 2}, state)):
        (first, _), (second, _) = gloo_pool2.run(export_task, layout, given)
        assert second == {}, "only rank 0 receives the model"
        assert sorted(first) == sorted(reference), layout
        for name, tensor in reference.items():
            assert torch.equal(first[name], tensor), (layout, name)


@pytest.mark.multiprocess
def test_ep2_gathers_every_expert_under_mixtral_names(gloo_pool1, gloo_pool2) -> None:
    ((reference, state),) = gloo_pool1.run(export_task, {}, None, True)
    experts = [n for n in reference if ".block_sparse_moe.experts." in n]
    assert len(experts) == 2 * 4 * 3  # 2 layers x 4 experts x w1 / w2 / w3
    assert reference["model.layers.1.block_sparse_moe.gate.weight"].shape == (4, 64)
    assert "model.layers.0.mlp.gate_proj.weight" not in reference
    # expert-parallel ranks draw other initial experts: load world size 1's, then gather
    (first, _), (second, _) = gloo_pool2.run(export_task, {"ep": 2}, state, True)
    assert second == {}
    assert sorted(first) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(first[name], tensor), name


def test_a_parameter_without_a_hugging_face_name_is_refused_by_name() -> None:
    assert hf_names("decoder.layers.1.mlp.linear_fc2.weight", {1: 5}) == (
        "model.layers.5.mlp.down_proj.weight"
    )
    with pytest.raises(WeightSyncError, match="decoder.layers.0.mlp.shared_experts"):
        hf_names("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", {0: 0})
