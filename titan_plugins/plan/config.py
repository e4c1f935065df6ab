"""The model, layout and training setup ``plan`` reasons about (``PlanConfig``).

Built from Megatron-LM flags by ``titan_plugins.plan.from_flags.build_config``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from titan_plugins.plan.flags import PlanError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass
class PlanConfig:
    """Everything the planner needs, in Megatron terms (per-flag docs in Megatron-LM)."""

    num_layers: int
    hidden: int
    heads: int
    ffn: int
    kv_channels: int
    query_groups: int
    seq: int
    vocab: int  # padded
    max_pos: int
    position_embedding: str
    layernorm: bool  # LayerNorm (weight + bias) vs RMSNorm (weight)
    gated: bool
    linear_bias: bool
    qkv_bias: bool
    qk_layernorm: bool
    untied: bool
    # MoE
    experts: int
    moe_ffn: int
    topk: int
    shared_ffn: int
    shared_gate: bool
    moe_pattern: list[int]
    # MLA
    mla: bool
    q_lora: int | None
    kv_lora: int
    qk_head: int
    qk_pos: int
    v_head: int
    # parallelism
    world: int
    tp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    cp: int
    sp: bool
    layout: str | None
    first_layers: int | None
    last_layers: int | None
    account_embedding: bool
    account_loss: bool
    # training
    mbs: int
    gbs: int
    param_dtype: str
    grad_bytes: int
    dist_opt: bool
    optimizer: str
    exp_avg_bytes: int
    exp_avg_sq_bytes: int
    main_param_bytes: int
    opt_offload_fraction: float
    fp8: bool
    fp8_recipe: str | None
    impl: str  # "transformer_engine" or "local"
    flash: bool
    softmax_fp32: bool  # --attention-softmax-in-fp32 (unfused attention keeps fp32 probabilities)
    attn_dropout: float
    hidden_dropout: float
    recompute_granularity: str | None
    recompute_modules: list[str] = field(default_factory=list)
    offload_modules: list[str] = field(default_factory=list)
    vp_group: int | None = None  # microbatch group size per virtual stage (None: PP)
    ep_overlap: bool = False  # --overlap-moe-expert-parallel-comm (combined 1F1B)

    @property
    def dp(self) -> int:
        """Data-parallel size of dense (non-expert) parameters."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Data-parallel size of expert parameters (expert DP)."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations (the compute dtype)."""
        return DTYPE_BYTES[self.param_dtype]

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each data-parallel rank."""
        return self.gbs // (self.mbs * self.dp)

    def is_moe(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) is an MoE layer."""
        return bool(self.experts) and bool(self.moe_pattern[layer])


def moe_pattern(spec: str | None, num_layers: int) -> list[int]:
    """Expand ``--moe-layer-freq`` (an int N or a list expression like ``([0]*1+[1]*60)``)."""
    if spec is None:
        return [1] * num_layers
    if "[" not in spec:
        freq = int(spec)
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]

    def ev(node: ast.AST) -> object:
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise PlanError(f"--moe-layer-freq: cannot read {spec!r} (use e.g. '([0]*1+[1]*60)')")

    try:
        pattern = ev(ast.parse(spec.strip(), mode="eval").body)
    except SyntaxError:
        raise PlanError(f"--moe-layer-freq: cannot read {spec!r}") from None
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise PlanError(
            f"--moe-layer-freq {spec!r} gives {len(pattern) if isinstance(pattern, list) else '?'}"
            f" entries, --num-layers is {num_layers}"
        )
    return [int(bool(x)) for x in pattern]
