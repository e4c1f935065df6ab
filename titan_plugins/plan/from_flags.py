"""Build a ``PlanConfig`` from Megatron-LM flags, with Megatron-LM's defaults and checks.

Defaults and derived values follow Megatron-LM core_v0.16.1 (``arguments.py`` / ``validate_args``):
ffn = 4 * hidden, kv_channels = hidden / heads, vocab padded to a multiple of
``make_vocab_size_divisible_by * tp``, bf16 gradients accumulated in fp32, etc. Contradictory or
unsupported flags raise ``PlanError`` naming the flag.
"""

from __future__ import annotations

import math

from titan_plugins.plan.config import DTYPE_BYTES, PlanConfig, moe_pattern
from titan_plugins.plan.flags import PlanError


def _int(flags: dict, name: str, default: int | None = None) -> int | None:
    value = flags.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PlanError(f"{name} needs an integer, got {value!r}") from None


def _float(flags: dict, name: str, default: float) -> float:
    value = flags.get(name)
    try:
        return default if value is None else float(value)
    except ValueError:
        raise PlanError(f"{name} needs a number, got {value!r}") from None


def _need(flags: dict, name: str) -> int:
    value = _int(flags, name)
    if value is None:
        raise PlanError(f"{name} is required")
    return value


def _conflict(flags: dict, a: str, b: str, why: str = "") -> None:
    if flags.get(a) is not None and flags.get(b) is not None:
        raise PlanError(f"{a} contradicts {b}{': ' + why if why else ''}")


def build_config(flags: dict, world: int) -> PlanConfig:
    """Make a ``PlanConfig`` from parsed Megatron flags and the world size (number of GPUs)."""
    if flags.get("--mtp-num-layers") is not None:
        raise PlanError("--mtp-num-layers: multi-token prediction layers are not modelled by plan")
    _conflict(flags, "--bf16", "--fp16", "choose one parameter dtype")
    _conflict(
        flags,
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
        "give one of them",
    )
    _conflict(flags, "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers")
    _conflict(flags, "--pipeline-model-parallel-layout", "--decoder-last-pipeline-num-layers")
    _conflict(flags, "--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage")
    _conflict(
        flags,
        "--pipeline-model-parallel-layout",
        "--num-virtual-stages-per-pipeline-rank",
        "the layout already sets the virtual stages",
    )
    _conflict(flags, "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32")

    layers = _need(flags, "--num-layers")
    hidden = _need(flags, "--hidden-size")
    heads = _need(flags, "--num-attention-heads")
    seq = _need(flags, "--seq-length")
    if hidden % heads:
        raise PlanError(f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}")
    tp = _int(flags, "--tensor-model-parallel-size", 1)
    pp = _int(flags, "--pipeline-model-parallel-size", 1)
    cp = _int(flags, "--context-parallel-size", 1)
    ep = _int(flags, "--expert-model-parallel-size", 1)
    etp = _int(flags, "--expert-tensor-parallel-size", tp)
    if world % (tp * pp * cp) or world % (etp * ep * pp):
        raise PlanError(
            f"world size {world} is not divisible by TP*PP*CP={tp * pp * cp} and "
            f"ETP*EP*PP={etp * ep * pp}: fix --tensor/--pipeline/--expert-model-parallel-size "
            f"or the number of GPUs (--world-size)"
        )
    vocab = _int(flags, "--vocab-size")
    if vocab is None:
        raise PlanError("--vocab-size is required (plan cannot load a tokenizer)")
    if flags.get("--tokenizer-type") == "NullTokenizer" and _null_tokenizer_adds_eod():
        vocab += 1  # up to 0.17, NullTokenizer adds the EOD token after --vocab-size
    multiple = _int(flags, "--make-vocab-size-divisible-by", 128) * tp
    vocab = math.ceil(vocab / multiple) * multiple

    experts = _int(flags, "--num-experts", 0) or 0
    if experts and experts % ep:
        raise PlanError(
            f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}"
        )
    if not experts and ep > 1:
        raise PlanError("--expert-model-parallel-size > 1 needs --num-experts")
    vpp = 1
    if flags.get("--num-virtual-stages-per-pipeline-rank") is not None:
        vpp = _int(flags, "--num-virtual-stages-per-pipeline-rank")
    elif flags.get("--num-layers-per-virtual-pipeline-stage") is not None:
        per = _int(flags, "--num-layers-per-virtual-pipeline-stage")
        if layers % (per * pp):
            raise PlanError(
                f"--num-layers-per-virtual-pipeline-stage {per}: --num-layers "
                f"{layers} is not divisible by {per} * PP {pp}"
            )
        vpp = layers // (per * pp)
    if vpp > 1 and pp == 1:
        raise PlanError("virtual pipeline stages need --pipeline-model-parallel-size > 1")

    bf16, fp16 = bool(flags.get("--bf16")), bool(flags.get("--fp16"))
    param_dtype = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if param_dtype == "bf16":
        grad_bytes = 2 if flags.get("--grad-reduce-in-bf16") else 4
    elif param_dtype == "fp16":
        grad_bytes = 4 if flags.get("--accumulate-allreduce-grads-in-fp32") else 2
    else:
        grad_bytes = 4
    if flags.get("--main-grads-dtype") == "bf16":
        grad_bytes = 2
    fp8 = flags.get("--fp8-format") is not None
    if flags.get("--fp8-recipe") is not None and not fp8:
        raise PlanError("--fp8-recipe needs --fp8-format (e.g. --fp8-format e4m3)")
    if fp8 and param_dtype == "fp32":
        raise PlanError("--fp8-format needs --bf16 or --fp16")
    optimizer = flags.get("--optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        raise PlanError(f"--optimizer {optimizer}: plan models adam and sgd")
    mla = bool(flags.get("--multi-latent-attention"))
    query_groups = heads
    if flags.get("--group-query-attention"):
        query_groups = _int(flags, "--num-query-groups", 1)
    elif flags.get("--num-query-groups") is not None:
        raise PlanError("--num-query-groups needs --group-query-attention")
    recompute = flags.get("--recompute-granularity")
    if flags.get("--recompute-activations"):
        recompute = "selective"
    modules = list(flags.get("--recompute-modules") or (["core_attn"] if recompute else []))
    mbs = _int(flags, "--micro-batch-size", 1)
    dp = world // (tp * pp * cp)
    gbs = _int(flags, "--global-batch-size", mbs * dp)
    if gbs % (mbs * dp):
        raise PlanError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{mbs} * data-parallel size {dp}"
        )
    impl = flags.get("--transformer-impl", "transformer_engine")
    backend = flags.get("--attention-backend", "auto")
    position = flags.get("--position-embedding-type", "learned_absolute")
    return PlanConfig(
        num_layers=layers,
        hidden=hidden,
        heads=heads,
        ffn=_int(flags, "--ffn-hidden-size", 4 * hidden),
        kv_channels=_int(flags, "--kv-channels", hidden // heads),
        query_groups=query_groups,
        seq=seq,
        vocab=vocab,
        max_pos=_int(flags, "--max-position-embeddings", seq),
        position_embedding=position,
        layernorm=flags.get("--normalization", "LayerNorm") == "LayerNorm",
        gated=bool(flags.get("--swiglu")),
        linear_bias=not flags.get("--disable-bias-linear"),
        qkv_bias=bool(flags.get("--add-qkv-bias")),
        qk_layernorm=bool(flags.get("--qk-layernorm")),
        untied=bool(flags.get("--untie-embeddings-and-output-weights")),
        experts=experts,
        moe_ffn=_int(flags, "--moe-ffn-hidden-size", _int(flags, "--ffn-hidden-size", 4 * hidden)),
        topk=_int(flags, "--moe-router-topk", 2),
        shared_ffn=_int(flags, "--moe-shared-expert-intermediate-size", 0) or 0,
        shared_gate=bool(flags.get("--moe-shared-expert-gate")),
        moe_pattern=moe_pattern(flags.get("--moe-layer-freq"), layers),
        mla=mla,
        q_lora=_int(flags, "--q-lora-rank"),
        kv_lora=_int(flags, "--kv-lora-rank", 32),
        qk_head=_int(flags, "--qk-head-dim", 128),
        qk_pos=_int(flags, "--qk-pos-emb-head-dim", 64),
        v_head=_int(flags, "--v-head-dim", 128),
        world=world,
        tp=tp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        etp=etp,
        cp=cp,
        sp=bool(flags.get("--sequence-parallel")) and tp > 1,
        layout=flags.get("--pipeline-model-parallel-layout"),
        first_layers=_int(flags, "--decoder-first-pipeline-num-layers"),
        last_layers=_int(flags, "--decoder-last-pipeline-num-layers"),
        account_embedding=bool(flags.get("--account-for-embedding-in-pipeline-split")),
        account_loss=bool(flags.get("--account-for-loss-in-pipeline-split")),
        mbs=mbs,
        gbs=gbs,
        param_dtype=param_dtype,
        grad_bytes=grad_bytes,
        dist_opt=bool(flags.get("--use-distributed-optimizer")),
        optimizer=optimizer,
        exp_avg_bytes=DTYPE_BYTES[flags.get("--exp-avg-dtype", "fp32")],
        exp_avg_sq_bytes=DTYPE_BYTES[flags.get("--exp-avg-sq-dtype", "fp32")],
        main_param_bytes=DTYPE_BYTES[flags.get("--main-params-dtype", "fp32")],
        opt_offload_fraction=(
            _float(flags, "--optimizer-offload-fraction", 1.0)
            if flags.get("--optimizer-cpu-offload")
            else 0.0
        ),
        fp8=fp8,
        fp8_recipe=flags.get("--fp8-recipe"),
        impl=impl,
        flash=impl == "transformer_engine" and backend in ("auto", "flash", "fused"),
        softmax_fp32=bool(flags.get("--attention-softmax-in-fp32"))
        or bool(flags.get("--apply-query-key-layer-scaling")),
        attn_dropout=_float(flags, "--attention-dropout", 0.1),
        hidden_dropout=_float(flags, "--hidden-dropout", 0.1),
        recompute_granularity=recompute,
        recompute_modules=modules,
        offload_modules=list(flags.get("--offload-modules") or [])
        if flags.get("--fine-grained-activation-offloading")
        else [],
        vp_group=_int(flags, "--microbatch-group-size-per-virtual-pipeline-stage"),
        ep_overlap=bool(flags.get("--overlap-moe-expert-parallel-comm")),
    )


def _null_tokenizer_adds_eod() -> bool:
    """Megatron-LM's NullTokenizer has ``--vocab-size + 1`` tokens up to 0.17 (the EOD token after
    them) and ``--vocab-size`` from 0.18 (megatron.core.tokenizers puts EOD inside). The line is
    the megatron-core this environment would import (read statically, never imported); with none
    found, the current line's rule."""
    from titan_plugins.patching import gates

    try:
        version = gates.resolve_version("megatron-core")[0]
    except Exception:  # an odd environment: plan for the current line
        version = None
    return version is not None and gates.version_key(version)[0] < (0, 18)
