"""A tiny Llama-style GPT on unmodified megatron-core (RMSNorm, SwiGLU, rotary embeddings,
grouped-query attention, untied output layer): the trainer model of the tests and the benchmark,
trained through megatron's own schedules by the core's CPU harness (``tiny_gpt``)."""

from __future__ import annotations

from typing import Any

import torch

ROPE_THETA = 10000.0  # megatron's default rotary base
MAX_POSITIONS = 256


def make_config(**overrides: Any) -> Any:
    """The ``TransformerConfig`` for the current parallel layout (``tiny_gpt.init_parallel``):
    dense unless ``num_moe_experts=4`` (then Mixtral-style: 4 experts, top-2, alltoall)."""
    import torch.nn.functional as F

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    fields: dict[str, Any] = dict(
        num_moe_experts=None,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        num_query_groups=2,
    )
    fields.update(overrides)
    return tiny_gpt.make_config(**fields)


def build(cfg: Any, **gpt_kwargs: Any) -> list:
    """This rank's model chunks (megatron DDP-wrapped, as training wants them)."""
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    return tiny_gpt.build_model(
        cfg, position_embedding_type="rope", share_embeddings_and_output_weights=False, **gpt_kwargs
    )


def hf_config(cfg: Any) -> dict:
    """Its Hugging Face ``config.json``."""
    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_weight_sync.hf_checkpoint import llama_config

    return llama_config(cfg, tiny_gpt.VOCAB, MAX_POSITIONS, ROPE_THETA)


def logits(chunks: list, input_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's own forward on one rank holding the whole model (PP=1): ``[b, s, vocab]``
    (tensor-parallel shards gathered when the model was built with ``parallel_output=False``)."""
    from titan_weight_sync.megatron_export import _unwrap

    model = _unwrap(chunks[0])
    model.eval()
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    with torch.no_grad():
        out = model(input_ids, positions, attention_mask=None)
    model.train()
    return out.float()
