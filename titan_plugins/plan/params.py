"""Parameter counts per rank, module by module, as megatron-core 0.16.1 builds a GPTModel.

Counts are per tensor-parallel rank (column-parallel weights and biases divided by TP, row-parallel
biases replicated) and per expert-parallel rank (``experts / EP`` local experts, divided by the
expert TP size). Norms, the router and the position embedding are replicated. Buffers (e.g. the
router's expert bias) are not parameters and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_plugins.plan.config import PlanConfig


@dataclass
class Params:
    """Parameter counts of one rank, split into dense (DP-sharded) and expert (expert-DP)."""

    dense: int = 0
    expert: int = 0

    def __add__(self, other: Params) -> Params:
        return Params(self.dense + other.dense, self.expert + other.expert)

    @property
    def total(self) -> int:
        """All parameters of the rank."""
        return self.dense + self.expert


def _norm(cfg: PlanConfig, size: int) -> int:
    return size * (2 if cfg.layernorm else 1)


def _mlp(cfg: PlanConfig, ffn: int, tp: int, bias: bool) -> int:
    fc1_out = ffn * (2 if cfg.gated else 1)
    fc1 = cfg.hidden * fc1_out // tp + (fc1_out // tp if bias else 0)
    fc2 = ffn // tp * cfg.hidden + (cfg.hidden if bias else 0)
    return fc1 + fc2


def attention_params(cfg: PlanConfig) -> int:
    """Self-attention parameters of one layer on one TP rank (MLA or standard/GQA)."""
    h, tp, bias = cfg.hidden, cfg.tp, cfg.linear_bias
    if cfg.mla:
        q_head = cfg.qk_head + cfg.qk_pos
        n = 0
        if cfg.q_lora is None:
            n += h * cfg.heads * q_head // tp
        else:
            n += h * cfg.q_lora // tp + cfg.q_lora * cfg.heads * q_head // tp
            n += _norm(cfg, cfg.q_lora) if cfg.qk_layernorm else 0
        n += h * (cfg.kv_lora + cfg.qk_pos) // tp
        n += cfg.kv_lora * cfg.heads * (cfg.qk_head + cfg.v_head) // tp
        n += _norm(cfg, cfg.kv_lora) if cfg.qk_layernorm else 0
        n += cfg.heads * cfg.v_head // tp * h + (h if bias else 0)
        return n
    qkv_out = (cfg.heads + 2 * cfg.query_groups) * cfg.kv_channels
    n = h * qkv_out // tp + (qkv_out // tp if bias or cfg.qkv_bias else 0)
    n += cfg.heads * cfg.kv_channels // tp * h + (h if bias else 0)
    if cfg.qk_layernorm:
        n += 2 * _norm(cfg, cfg.kv_channels)
    return n


def layer_params(cfg: PlanConfig, layer: int) -> Params:
    """Parameters of transformer layer ``layer`` (0-based) on one rank."""
    dense = _norm(cfg, cfg.hidden) * 2 + attention_params(cfg)
    if not cfg.is_moe(layer):
        return Params(dense + _mlp(cfg, cfg.ffn, cfg.tp, cfg.linear_bias))
    dense += cfg.experts * cfg.hidden + (cfg.experts if cfg.linear_bias else 0)  # router
    if cfg.shared_ffn:
        dense += _mlp(cfg, cfg.shared_ffn, cfg.tp, False)
        dense += cfg.hidden if cfg.shared_gate else 0
    local = cfg.experts // cfg.ep
    return Params(dense, local * _mlp(cfg, cfg.moe_ffn, cfg.etp, cfg.linear_bias))


def embedding_params(cfg: PlanConfig) -> int:
    """Word (and learned position) embedding on the first stage."""
    n = cfg.vocab // cfg.tp * cfg.hidden
    if cfg.position_embedding == "learned_absolute":
        n += cfg.max_pos * cfg.hidden
    return n


def head_params(cfg: PlanConfig) -> int:
    """Final norm plus output layer on the last stage.

    With tied embeddings and PP > 1 the last stage holds its own copy of the word embedding
    (kept in sync by an all-reduce), so it counts there too.
    """
    n = _norm(cfg, cfg.hidden)
    if cfg.untied or cfg.pp > 1:
        n += cfg.vocab // cfg.tp * cfg.hidden
    return n


def total_params(cfg: PlanConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, for reporting and FLOPs."""
    one = replace(cfg, tp=1, ep=1, etp=1)
    total = active = 0
    for i in range(cfg.num_layers):
        p = layer_params(one, i)
        total += p.total
        active += p.dense + (p.expert // cfg.experts * cfg.topk if cfg.is_moe(i) else 0)
    emb = embedding_params(one)
    head = head_params(replace(one, pp=1))
    return total + emb + head, active + emb + head
