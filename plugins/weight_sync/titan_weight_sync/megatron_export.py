"""Megatron GPT chunks -> the Hugging Face weights of the same model (Llama / Qwen2 / Qwen3
names and layouts; Mixtral's for a MoE GPT), gathered over tensor, expert, pipeline and data
parallelism.

Every rank calls :func:`gather_hf_weights`. A rank holds Megatron shards: a column-parallel weight
split on dim 0, a row-parallel one on dim 1, the layers of its pipeline stage. Each tensor-parallel
weight is all-gathered in its group. Only the first data-parallel replica of each stage
contributes. Rank ``dst`` gets the whole model, keyed by Hugging Face names; the other ranks get
an empty dict.

The layout rules are Megatron's own:

- ``linear_qkv`` holds, per query group, that group's query heads, then one key and one value
  head;
- ``linear_fc1`` of a gated MLP holds ``[gate; up]`` on every tensor-parallel rank, so the full
  weight interleaves gate and up per rank;
- a MoE layer's router is Mixtral's gate, and each local expert ``j`` is global expert
  ``local_expert_indices[j]``, held by one expert-parallel rank; its ``linear_fc1`` / ``linear_fc2``
  are Mixtral's ``w1`` (gate) and ``w3`` (up) / ``w2``. Megatron's default routing (top-k of the
  logits, then a softmax over those k) is Mixtral's (softmax, top-k, renormalised).

A parameter this module has no name for is refused by name: the framework's own path then runs.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_weight_sync.errors import WeightSyncError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_IN_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _full(param: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """The tensor-parallel shards of ``param`` from every rank of ``group``, in rank order."""
    import torch.distributed as dist

    size = dist.get_world_size(group) if group is not None else 1
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return shards


def _split_qkv(weight: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, ...]:
    groups = cfg.num_query_groups or cfg.num_attention_heads
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    per_group = cfg.num_attention_heads // groups
    grouped = weight.reshape(groups, (per_group + 2) * head_dim, *weight.shape[1:])
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *weight.shape[1:]).clone() for t in (q, k, v))


def hf_names(name: str, layer_offset: dict[int, int]) -> str:
    """The Hugging Face name of one Megatron parameter name (``layer_offset``: local layer
    index -> global); raises for a parameter without one."""
    if name in _TOP:
        return _TOP[name]
    match = _LAYER.match(name)
    if match is not None:
        layer, rest = layer_offset[int(match.group(1))], match.group(2)
        if rest in _IN_LAYER:
            return f"model.layers.{layer}.{_IN_LAYER[rest]}"
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            return f"model.layers.{layer}.self_attn.qkv.{rest.rsplit('.', 1)[1]}"
        if rest == "mlp.linear_fc1.weight":
            return f"model.layers.{layer}.mlp.fc1.weight"
        if rest == "mlp.router.weight":
            return f"model.layers.{layer}.block_sparse_moe.gate.weight"
    raise WeightSyncError(
        f"weight_sync: no Hugging Face name for Megatron parameter {name!r} (served: Llama / "
        "Qwen-style dense GPTs and Mixtral-style MoE GPTs); use the framework's own weight "
        "update for this model"
    )


def _expert_weights(layer: Any, rest: str, shards: list[torch.Tensor], cfg: Any) -> dict:
    """Mixtral's names for one local expert's weight (``rest`` matched :data:`_EXPERT`)."""
    match = _EXPERT.match(rest)
    assert match is not None
    expert = layer.mlp.local_expert_indices[int(match.group(1))]
    base = f"model.layers.{layer.layer_number - 1}.block_sparse_moe.experts.{expert}."
    if match.group(2) == "linear_fc2":
        full = torch.cat(shards, dim=1) if len(shards) > 1 else shards[0].clone()
        return {base + "w2.weight": full}
    if not cfg.gated_linear_unit:
        raise WeightSyncError("weight_sync: a non-gated MoE expert has no Mixtral name")
    halves = [s.chunk(2, dim=0) for s in shards]
    return {
        base + "w1.weight": torch.cat([h[0] for h in halves]),
        base + "w3.weight": torch.cat([h[1] for h in halves]),
    }


def local_hf_weights(chunks: list, cfg: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """The Hugging Face weights of this rank's pipeline stage, tensor-parallel shards gathered:
    ``(dense, experts)``, the experts being the ones this expert-parallel rank holds."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    etp_group = ps.get_expert_tensor_parallel_group()
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        model = _unwrap(chunk)
        layers = getattr(getattr(model, "decoder", None), "layers", [])
        offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
        for name, param in model.named_parameters():
            match = _LAYER.match(name)
            if match is not None and _EXPERT.match(match.group(2)):  # a local expert's weight
                layer = layers[int(match.group(1))]
                experts.update(_expert_weights(layer, match.group(2), _full(param, etp_group), cfg))
                continue
            if match is not None and ".experts." in match.group(2):
                raise WeightSyncError(
                    f"weight_sync: expert weight {name!r} has no Mixtral name (grouped-GEMM "
                    "experts are not served yet); use the framework's own weight update"
                )
            hf = hf_names(name, offsets)
            shards = _full(param, tp_group)
            if hf.endswith(".mlp.fc1.weight") and cfg.gated_linear_unit:
                halves = [s.chunk(2, dim=0) for s in shards]
                base = hf[: -len("fc1.weight")]
                out[base + "gate_proj.weight"] = torch.cat([h[0] for h in halves])
                out[base + "up_proj.weight"] = torch.cat([h[1] for h in halves])
                continue
            dim = getattr(param, "partition_dim", 0) if len(shards) > 1 else 0
            full = torch.cat(shards, dim=dim) if len(shards) > 1 else shards[0].clone()
            if ".self_attn.qkv." in hf:
                base, kind = hf.split(".self_attn.qkv.")
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(full, cfg)):
                    out[f"{base}.self_attn.{proj}.{kind}"] = part
                continue
            if hf.endswith(".mlp.fc1.weight"):
                raise WeightSyncError("weight_sync: a non-gated MLP has no Llama / Qwen name")
            out[hf] = full
    return out, experts


def gather_hf_weights(chunks: list, cfg: Any, dst: int = 0) -> dict[str, torch.Tensor]:
    """The whole model's Hugging Face weights on global rank ``dst`` (``{}`` elsewhere); a
    collective of every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense, experts = local_hf_weights(chunks, cfg)
    first_replica = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    first_expert_replica = (
        ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    )
    mine = {**(dense if first_replica else {}), **(experts if first_expert_replica else {})}
    if dist.get_world_size() == 1:
        return mine
    found: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(mine, found if dist.get_rank() == dst else None, dst=dst)
    if dist.get_rank() != dst:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in found:
        merged.update(part or {})
    return merged
