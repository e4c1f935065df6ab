"""Bytes a transformer layer saves for backward per microbatch, tensor by tensor.

Each saved tensor is an ``Entry`` with its byte count, the Megatron module tag it belongs to
(``--offload-modules`` / ``--recompute-modules`` names), and whether it is the input of a linear
layer (what ``fp8_blockwise`` stores as FP8 plus 1x128 fp32 scales). Two attention paths:
``transformer_engine`` with flash/fused attention (saves Q, K, V, the output and the softmax
statistics) and ``local`` (unfused: saves the softmax probabilities, b*heads*s*s). Expert tokens
assume balanced routing (``tokens * topk`` per EP rank). Recompute drops what the recomputed
module would otherwise save; ``--recompute-granularity full`` keeps only each layer's input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_plugins.plan.config import PlanConfig

TILE = 128  # fp8_blockwise keeps saved linear inputs token-tiled: one fp32 scale per 1x128 tile


@dataclass
class Entry:
    """One saved tensor (or group of same-role tensors) of a layer."""

    name: str
    elements: float
    dtype_bytes: float
    module: str  # the part that saves it (attn_norm, core_attn, moe, head, ...): for reports
    linear_input: bool = False
    tiles: float = 0.0  # 1x128 scale tiles of the FP8 copy (linear inputs)
    fp8_only: bool = False  # an FP8 copy of a tensor that is saved anyway (shares it otherwise)
    fp8_scale: float = 1.0  # element growth under FP8 (experts pad tokens to the FP8 alignment)
    pieces: int = 1  # separate tensors it stands for (one per local expert for expert tensors)

    @property
    def bytes(self) -> float:
        """Bytes as stored without FP8."""
        return 0.0 if self.fp8_only else self.elements * self.dtype_bytes

    def fp8_bytes(self) -> float:
        """Bytes under blockwise FP8: linear inputs as E4M3 + fp32 tile scales, others as is."""
        elements = self.elements * self.fp8_scale
        if self.linear_input:
            return elements + 4 * self.tiles
        return 0.0 if self.fp8_only else elements * self.dtype_bytes


def _linear_input(
    name: str,
    elements: float,
    a: int,
    module: str,
    tokens: float,
    groups: int = 1,
    fp8_only: bool = False,
    fp8_tokens: float = 0,
) -> Entry:
    """A linear layer's saved input; its FP8 copy is tiled along the tokens of each group.

    ``fp8_tokens``: the token count under FP8 when it differs (expert padding).
    """
    fp8_tokens = fp8_tokens or tokens
    features = elements / tokens if tokens else 0
    tiles = features * groups * math.ceil(fp8_tokens / groups / TILE) if tokens else 0
    scale = fp8_tokens / tokens if tokens else 1.0
    return Entry(name, elements, a, module, True, tiles, fp8_only, scale, groups)


def _stats_bytes(cfg: PlanConfig) -> int:
    # TE norms keep fp32 statistics; torch's norms keep them in the activation dtype
    return 4 if cfg.impl == "transformer_engine" else cfg.act_bytes


def _tokens(cfg: PlanConfig) -> float:
    return cfg.seq * cfg.mbs / cfg.cp


def _qk_extras(cfg: PlanConfig, t: float, a: int) -> list[Entry]:
    """Copies of q / k / v that q-k norms, RoPE and (local) GQA head expansion keep."""
    out: list[Entry] = []
    d, q_heads, kv_heads = cfg.kv_channels, cfg.heads / cfg.tp, cfg.query_groups / cfg.tp
    local_gqa = cfg.impl == "local" and cfg.query_groups < cfg.heads
    if cfg.qk_layernorm:  # q/k norms keep their outputs and statistics
        qk = t * (q_heads + kv_heads)
        out.append(Entry("qk_norm_output", qk * d, a, "core_attn"))
        stats = _stats_bytes(cfg)
        out.append(Entry("qk_norm_stats", qk * (2 if cfg.layernorm else 1), stats, "core_attn"))
        if local_gqa:  # q is split out of the grouped qkv as its own tensor
            out.append(Entry("q_split", t * q_heads * d, a, "core_attn"))
    rope = cfg.position_embedding == "rope"
    if rope:  # rotated q (and k) are new tensors; cos/sin tables per layer
        out.append(Entry("q_rotated", t * q_heads * d, a, "core_attn"))
        out.append(Entry("rope_tables", 4 * cfg.seq * d, 4, "core_attn"))
    if local_gqa:  # unfused attention repeats k and v to every query head
        out.append(Entry("kv_expanded", 2 * t * q_heads * d, a, "core_attn"))
    elif rope:
        out.append(Entry("k_rotated", t * kv_heads * d, a, "core_attn"))
    return out


def _attention(cfg: PlanConfig, t: float, a: int) -> list[Entry]:
    tp = cfg.tp
    sp = tp if cfg.sp else 1
    heads = cfg.heads / tp
    seq_local = cfg.seq / cfg.cp
    out: list[Entry] = [Entry("attn_norm_input", t * cfg.hidden / sp, a, "attn_norm")]
    stats = _stats_bytes(cfg)
    out.append(Entry("attn_norm_stats", t * (2 if cfg.layernorm else 1) / sp, stats, "layernorm"))
    out.append(_linear_input("attn_norm_output", t * cfg.hidden / sp, a, "layernorm", t / sp))
    if cfg.mla:
        q_head = cfg.qk_head + cfg.qk_pos
        if cfg.q_lora is not None:
            out.append(Entry("q_down_output", t * cfg.q_lora, a, "mla_norm"))
            out.append(_linear_input("q_norm_output", t * cfg.q_lora, a, "mla_norm", t))
        out.append(Entry("kv_down_output", t * (cfg.kv_lora + cfg.qk_pos), a, "mla_norm"))
        out.append(_linear_input("kv_norm_output", t * cfg.kv_lora, a, "mla_norm", t))
        qkv = t * heads * (2 * q_head + cfg.v_head)
        value_dim = cfg.v_head
    else:
        qkv = t * (cfg.heads + 2 * cfg.query_groups) * cfg.kv_channels / tp
        value_dim = cfg.kv_channels
    out.append(Entry("q_k_v", qkv, a, "core_attn"))
    if not cfg.mla:
        out += _qk_extras(cfg, t, a)
    context = t * heads * value_dim
    if cfg.flash:
        out.append(Entry("softmax_stats", cfg.mbs * heads * seq_local, 4, "core_attn"))
    else:
        probs = cfg.mbs * heads * seq_local * seq_local
        if cfg.softmax_fp32 and a != 4:  # fp32 softmax output, and its cast for probs @ v
            out.append(Entry("attention_probs", probs, 4 + a, "core_attn"))
        else:
            out.append(Entry("attention_probs", probs, a, "core_attn"))
        if cfg.attn_dropout > 0:
            out.append(Entry("attention_dropout_mask", probs, 1, "core_attn"))
    out.append(_linear_input("attn_proj_input", context, a, "attn_proj", t))
    if cfg.hidden_dropout > 0:
        out.append(Entry("attn_dropout_mask", t * cfg.hidden / sp, 1, "attn_proj"))
    return out


def _mlp_part(cfg: PlanConfig, t: float, a: int, moe: bool) -> list[Entry]:
    sp = cfg.tp if cfg.sp else 1
    gate = 2 if cfg.gated else 1
    local_glu = cfg.gated and cfg.impl == "local"
    stats = _stats_bytes(cfg)
    norm_out = t * cfg.hidden / sp
    out = [
        Entry("mlp_norm_input", t * cfg.hidden / sp, a, "mlp_norm"),
        Entry("mlp_norm_stats", t * (2 if cfg.layernorm else 1) / sp, stats, "layernorm"),
        # MoE: the router keeps it in high precision; experts quantize their own copies
        _linear_input("mlp_norm_output", norm_out, a, "layernorm", t / sp)
        if not moe
        else Entry("mlp_norm_output", norm_out, a, "layernorm"),
    ]
    if cfg.hidden_dropout > 0:
        out.append(Entry("mlp_dropout_mask", t * cfg.hidden / sp, 1, "mlp"))
    if not moe:
        out.append(Entry("fc1_output", t * gate * cfg.ffn / cfg.tp, a, "mlp"))
        out.append(_linear_input("fc2_input", t * cfg.ffn / cfg.tp, a, "mlp", t))
        if local_glu:  # unfused silu(x1) * x2 keeps two more f-sized intermediates
            out.append(Entry("glu_intermediate", 2 * t * cfg.ffn / cfg.tp, a, "mlp"))
        return out
    e, k = cfg.experts, cfg.topk
    # scores/probs (fp32), routing map (bool), top-k values and indices, sort indices
    out.append(Entry("router", t * e * 9 + t * k * 28, 1, "moe"))
    routed = t * k  # tokens arriving at this EP rank's experts, balanced routing
    f = cfg.moe_ffn / cfg.etp
    local = cfg.experts // cfg.ep
    # Under FP8 each local expert pads its tokens to the GEMM alignment (megatron's
    # Fp8Padding / _pad_tensor_for_quantization): (align - 1) / 2 rows expected per expert.
    align = 32 if cfg.fp8_recipe == "mxfp8" else 16
    padded = routed + local * (align - 1) / 2
    grow = padded / routed
    out.append(
        _linear_input(
            "expert_fc1_input",
            routed * cfg.hidden,
            a,
            "expert_fc1",
            routed,
            local,
            fp8_tokens=padded,
        )
    )
    out.append(
        Entry("expert_fc1_output", routed * gate * f, a, "moe", fp8_scale=grow, pieces=local)
    )
    out.append(
        _linear_input(
            "expert_fc2_input", routed * f, a, "moe_act", routed, local, fp8_tokens=padded
        )
    )
    if cfg.impl == "local":  # unfused: activation output before the routing-prob weighting
        out.append(
            Entry(
                "expert_act_output",
                routed * f * (3 if local_glu else 1),
                a,
                "moe_act",
                fp8_scale=grow,
                pieces=local,
            )
        )
    out.append(Entry("expert_probs", routed, 4, "moe", fp8_scale=grow, pieces=local))
    if cfg.shared_ffn:
        s = cfg.shared_ffn / cfg.tp
        out.append(Entry("shared_fc1_output", t * gate * s, a, "shared_experts"))
        out.append(
            _linear_input("shared_fc1_input", norm_out, a, "shared_experts", t / sp, fp8_only=True)
        )
        out.append(_linear_input("shared_fc2_input", t * s, a, "shared_experts", t))
        if local_glu:
            out.append(Entry("shared_glu_intermediate", 2 * t * s, a, "shared_experts"))
    return out


# What each --recompute-modules choice stops saving (megatron-core 0.16.1 semantics): the
# checkpointed region keeps its inputs and drops what it saved inside.
_ROPE_COPIES = {"q_rotated", "k_rotated", "rope_tables", "kv_expanded", "q_split"}
RECOMPUTE_DROPS = {
    "core_attn": {"attention_probs", "softmax_stats", "attention_dropout_mask"},
    "layernorm": {"attn_norm_output", "attn_norm_stats", "mlp_norm_output", "mlp_norm_stats"},
    "mla_up_proj": {"q_k_v"} | _ROPE_COPIES,
    "mlp": {"fc1_output", "fc2_input", "glu_intermediate"},
    "moe": {
        "router",
        "expert_fc1_input",
        "expert_fc1_output",
        "expert_fc2_input",
        "expert_act_output",
        "expert_probs",
        "shared_fc1_output",
        "shared_fc2_input",
        "shared_glu_intermediate",
    },
    "moe_act": {"expert_fc2_input", "expert_act_output"},
    "shared_experts": {"shared_fc1_output", "shared_fc2_input", "shared_glu_intermediate"},
}


def _recomputed(cfg: PlanConfig, entry: Entry) -> bool:
    return any(entry.name in RECOMPUTE_DROPS.get(m, ()) for m in cfg.recompute_modules)


def layer_entries(cfg: PlanConfig, moe: bool) -> list[Entry]:
    """Saved tensors of one transformer layer for one microbatch on one rank."""
    t, a = _tokens(cfg), cfg.act_bytes
    if cfg.recompute_granularity == "full":
        sp = cfg.tp if cfg.sp else 1
        return [Entry("layer_input", t * cfg.hidden / sp, a, "layer_input")]
    entries = _attention(cfg, t, a) + _mlp_part(cfg, t, a, moe)
    if cfg.recompute_granularity == "selective":
        entries = [x for x in entries if not _recomputed(cfg, x)]
    return entries


def embedding_entries(cfg: PlanConfig) -> list[Entry]:
    """Saved tensors of the embedding (token and position ids)."""
    return [Entry("token_ids", 2 * cfg.mbs * cfg.seq / cfg.cp, 8, "embedding")]


def head_entries(cfg: PlanConfig) -> list[Entry]:
    """Final norm, output layer input and the cross-entropy softmax (fp32) on the last stage."""
    t, a = _tokens(cfg), cfg.act_bytes
    sp = cfg.tp if cfg.sp else 1
    return [
        Entry("final_norm_input", t * cfg.hidden / sp, a, "head"),
        Entry("final_norm_stats", t * (2 if cfg.layernorm else 1) / sp, _stats_bytes(cfg), "head"),
        Entry("output_layer_input", t * cfg.hidden / sp, a, "head"),  # head stays high precision
        Entry("cross_entropy", t * cfg.vocab / cfg.tp, 4, "head"),
        Entry("labels_mask", t, 9, "head"),
    ]
