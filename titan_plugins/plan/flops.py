"""Model FLOPs per training step (forward + backward, no recompute) and the MFU a step time implies.

Same accounting as Megatron-LM's ``num_floating_point_operations`` (training.py): matmul FLOPs
only, 3x for forward + backward, causal attention counted at half, MoE layers at top-k routed
experts plus the shared expert, MLA with its low-rank projections, and the output layer.
"""

from __future__ import annotations

from titan_plugins.plan.config import PlanConfig


def _attention_term(cfg: PlanConfig) -> float:
    """Per-token forward+backward attention FLOPs of one layer (without the factor batch*seq)."""
    h, s, a = cfg.hidden, cfg.seq, cfg.heads
    if cfg.mla:
        q_head = cfg.qk_head + cfg.qk_pos
        if cfg.q_lora is None:
            q_term = h * a * q_head
        else:
            q_term = cfg.q_lora * (h + a * q_head + 1)
        return 6 * (
            q_term
            + cfg.kv_lora * (h + a * (cfg.qk_head + cfg.v_head) + 1)
            + h * cfg.qk_pos
            + a * cfg.v_head * h
            + s * a * q_head / 2
            + s * a * cfg.v_head / 2
        )
    q = cfg.kv_channels * a
    kv = cfg.kv_channels * cfg.query_groups
    return 6 * (h * (q + 2 * kv) + q * s / 2 * 2 + q * h)


def flops_per_step(cfg: PlanConfig) -> float:
    """Model FLOPs of one optimizer step over the global batch."""
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    ffn_factor = 3 if cfg.gated else 2
    mlp = (
        6
        * cfg.hidden
        * ffn_factor
        * (cfg.ffn * dense_layers + (cfg.moe_ffn * cfg.topk + cfg.shared_ffn) * moe_layers)
    )
    per_token = mlp + _attention_term(cfg) * cfg.num_layers + 6 * cfg.hidden * cfg.vocab
    return cfg.gbs * cfg.seq * per_token


def mfu(cfg: PlanConfig, step_time_s: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: step FLOPs / (step time * GPUs * peak FLOP/s per GPU)."""
    return flops_per_step(cfg) / (step_time_s * cfg.world * peak_tflops * 1e12)
