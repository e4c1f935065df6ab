"""``plan`` against memory measured on CPU for tiny GPTs built by unmodified megatron-core.

Parameters, gradients and distributed-optimizer (ZeRO-1) state bytes must match exactly;
activations saved for backward (measured with ``saved_tensors_hooks``, deduplicated by storage,
parameters excluded) within 10%. Two data-parallel ranks (``gloo_pool2``) so ZeRO-1 really shards.
"""

from __future__ import annotations

import pytest

from titan_plugins.plan.flags import parse_flags
from titan_plugins.plan.from_flags import build_config
from titan_plugins.plan.layout import parse_layout
from titan_plugins.plan.memory import stage_memory

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --num-experts 4 "
    "--moe-router-topk 2 --vocab-size 128 --make-vocab-size-divisible-by 1 "
    "--disable-bias-linear --transformer-impl local --hidden-dropout 0 --attention-dropout 0 "
    "--untie-embeddings-and-output-weights --use-distributed-optimizer "
    "--attention-softmax-in-fp32"  # TransformerConfig's default, which tiny_gpt keeps
).split()

# (extra Megatron flags, matching TransformerConfig overrides, GPTModel position embedding)
CASES = {
    "moe_fp32": ([], {}, "learned_absolute"),
    "moe_bf16": (["--bf16"], {"bf16": True, "params_dtype": "bf16"}, "learned_absolute"),
    "dense_first_swiglu_shared_qkln": (
        "--swiglu --moe-shared-expert-intermediate-size 64 --moe-layer-freq ([0]*1+[1]*1) "
        "--qk-layernorm --moe-ffn-hidden-size 32".split(),
        dict(
            gated_linear_unit=True,
            moe_shared_expert_intermediate_size=64,
            moe_layer_freq=[0, 1],
            qk_layernorm=True,
            moe_ffn_hidden_size=32,
        ),
        "learned_absolute",
    ),
    "rmsnorm_rope_gqa": (
        "--swiglu --normalization RMSNorm --position-embedding-type rope "
        "--group-query-attention --num-query-groups 2 --qk-layernorm".split(),
        dict(
            gated_linear_unit=True, normalization="RMSNorm", num_query_groups=2, qk_layernorm=True
        ),
        "rope",
    ),
}


def measure(overrides: dict, position: str, plugin: str | None = None, ep: int = 1) -> dict:
    """Worker task: build, run one step, return measured bytes (params, grads, optim, acts).

    ``plugin``: run with that installed Titan plugin active (``plugin_active``); ``ep``: expert
    parallel size (experts split over the ranks, expert DP = world / EP).
    """
    import contextlib

    from titan_plugins.testing import plugin_active

    with plugin_active(plugin) if plugin else contextlib.nullcontext():
        return _measure(overrides, position, ep)


def _gpt(cfg: object, spec: object, position: str) -> object:
    """megatron's GPTModel of the tiny vocabulary and sequence, untied embeddings."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    return GPTModel(
        cfg,
        spec,
        vocab_size=tiny_gpt.VOCAB,
        max_sequence_length=tiny_gpt.SEQ,
        share_embeddings_and_output_weights=False,
        position_embedding_type=position,
    )


def _measure(overrides: dict, position: str, ep: int) -> dict:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        clear_aux_losses_tracker,
    )

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel(ep=ep)
    overrides = dict(overrides)
    if overrides.get("params_dtype") == "bf16":
        overrides["params_dtype"] = torch.bfloat16
    cfg = tiny_gpt.make_config(**overrides)
    model = _gpt(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), position)
    half = bool(cfg.bf16)
    module = Float16Module(cfg, model) if half else model
    ddp = DistributedDataParallel(
        cfg,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        module,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            bf16=half,
            params_dtype=cfg.params_dtype,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    params = list(ddp.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    batch = tiny_gpt.fixed_batches(1)[0]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        out.float().sum().backward()
        ddp.finish_grad_sync()
        opt.step()
    finally:
        # A backward outside megatron's schedules leaves a 0-d aux-loss scale on the class that
        # later schedule runs in this shared worker cannot copy their [1]-shaped scale into.
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        clear_aux_losses_tracker()
    opt_bytes = 0
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                for value in inner.optimizer.state.get(p, {}).values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        opt_bytes += value.numel() * value.element_size()
                if half:  # fp32 main-param shard the distributed optimizer keeps
                    opt_bytes += p.numel() * p.element_size()
    return {
        "params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
        "optimizer_bytes": opt_bytes,
        "activation_bytes": sum(saved.values()),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_matches_measured_memory(gloo_pool2, case: str) -> None:
    extra, overrides, position = CASES[case]
    ranks = gloo_pool2.run(measure, overrides, position, timeout=240)
    stage = stage_memory(build_config(parse_flags(BASE + extra), world=2))[0]
    for rank in ranks:
        assert rank["params"] == stage.params.total
        assert rank["param_bytes"] == stage.param_bytes
        assert rank["grad_bytes"] == stage.grad_bytes
        assert abs(rank["activation_bytes"] / stage.act_per_microbatch - 1) < 0.10, rank
    # ZeRO-1 shards differ per rank only by bucket padding; together they hold every parameter.
    assert sum(r["optimizer_bytes"] for r in ranks) == 2 * stage.optimizer_bytes
    assert all(r["optimizer_bytes"] < stage.optimizer_bytes * 1.2 for r in ranks)


MLA_FLAGS = (
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
    "--qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm --normalization RMSNorm --swiglu "
    "--moe-shared-expert-intermediate-size 64 --moe-layer-freq ([0]*1+[1]*1) "
    "--moe-ffn-hidden-size 32 --position-embedding-type rope"
).split()


def count_mla_params() -> int:
    """Worker task: parameters of a tiny MLA MoE GPT (layer structure of Kimi-K2 / DeepSeek-V3).

    megatron-core 0.16.1's local DotProductAttention cannot serve MLA (it rejects ``k_channels``)
    and Transformer Engine does not run on CPU, so the parameter-free core attention is swapped
    for a stand-in; every parameterised module is megatron's own.
    """
    import dataclasses

    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    class NoParamAttention(torch.nn.Module):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__()

    tiny_gpt.init_parallel()
    base = tiny_gpt.make_config()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields.update(
        multi_latent_attention=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        qk_layernorm=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        moe_shared_expert_intermediate_size=64,
        moe_layer_freq=[0, 1],
        moe_ffn_hidden_size=32,
        rope_type="rope",
    )
    cfg = MLATransformerConfig(**fields)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = NoParamAttention
    # The worker's harness makes HAVE_TE look true while TELinear is None; MLA then calls
    # isinstance(x, None). Only this build needs the honest value.
    had_te = mla_module.HAVE_TE
    mla_module.HAVE_TE = False
    try:
        model = _gpt(cfg, spec, "rope")
    finally:
        mla_module.HAVE_TE = had_te
    return sum(p.numel() for p in model.parameters())


def test_plan_counts_mla_parameters_exactly(gloo_pool2) -> None:
    measured = gloo_pool2.run(count_mla_params, timeout=120)
    stage = stage_memory(build_config(parse_flags(BASE + MLA_FLAGS), world=2))[0]
    assert measured == [stage.params.total] * 2


def measure_pipeline_peak(num_microbatches: int, vpp: int | None = None) -> float:
    """Worker task: peak live saved-activation bytes of this rank over one step at PP=2.

    1F1B, or interleaved with ``vpp`` model chunks (unbatched P2P: megatron's batched P2P swaps
    tensors when the previous and next rank are the same one, see DESIGN.md section 7).

    Saved tensors are tracked from pack (``saved_tensors_hooks``) until autograd releases them
    after their backward; storages are counted once, parameters never.
    """
    import torch

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel(pp=2, vpp=vpp)
    cfg = tiny_gpt.make_config(batch_p2p_comm=False) if vpp else tiny_gpt.make_config()
    chunks = tiny_gpt.build_model(cfg)
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    live: dict[int, list[int]] = {}  # storage -> [bytes, references]
    state = {"now": 0, "peak": 0}

    class Saved:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor
            self.key = tensor.untyped_storage().data_ptr()
            if self.key in params:
                self.key = None
                return
            entry = live.setdefault(self.key, [tensor.untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                state["now"] += entry[0]
                state["peak"] = max(state["peak"], state["now"])
            entry[1] += 1

        def __del__(self) -> None:
            if self.key is not None:
                entry = live[self.key]
                entry[1] -= 1
                if entry[1] == 0:
                    state["now"] -= entry[0]
                    del live[self.key]

    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor):
        tiny_gpt.train(chunks, cfg, steps=1, num_microbatches=num_microbatches)
    return state["peak"]


def test_plan_matches_measured_peak_under_1f1b(gloo_pool2) -> None:
    """Stage 0 holds 2 microbatches in flight under 1F1B at PP=2, stage 1 one."""
    peaks = gloo_pool2.run(measure_pipeline_peak, 4, timeout=240)
    flags = [f for f in BASE if f != "--untie-embeddings-and-output-weights"]
    cfg = build_config(
        parse_flags(flags + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]),
        world=2,
    )
    stages = stage_memory(cfg)
    assert [s.in_flight for s in stages] == [2, 1]
    for measured, stage in zip(peaks, stages):
        assert abs(measured / stage.activations["configured"] - 1) < 0.10, (measured, stage)


def test_plan_matches_measured_peak_interleaved(gloo_pool2) -> None:
    """PP=2 x VPP=2: rank 0 warms up 2 (pp - 1) + (vpp - 1) pp = 4 chunk-microbatches, rank 1 two."""
    peaks = gloo_pool2.run(measure_pipeline_peak, 4, 2, timeout=240)
    flags = [f for f in BASE if f != "--untie-embeddings-and-output-weights"]
    flags += [
        "--num-layers",
        "4",
        "--pipeline-model-parallel-size",
        "2",  # the last value wins
        "--num-virtual-stages-per-pipeline-rank",
        "2",
        "--global-batch-size",
        "8",
    ]
    cfg = build_config(parse_flags(flags), world=2)
    stages = stage_memory(cfg)
    assert [s.in_flight for s in stages] == [5, 3]
    for measured, stage in zip(peaks, stages):
        assert abs(measured / stage.activations["configured"] - 1) < 0.10, (measured, stage)


def _installed(plugin: str) -> bool:
    from importlib import metadata

    return any(ep.name == plugin for ep in metadata.entry_points(group="titan_plugins"))


@pytest.mark.skipif(not _installed("fp8_blockwise"), reason="titan-fp8-blockwise not installed")
def test_plan_fp8_storage_matches_the_fp8_blockwise_plugin(gloo_pool2) -> None:
    """With the plugin, linear inputs are saved as E4M3 + 1x128 fp32 scales; experts pad their
    tokens to the FP8 alignment (the plan uses the expected padding, the tiny model's routing
    decides the real one)."""
    overrides = {"bf16": True, "params_dtype": "bf16", "fp8": "e4m3", "fp8_recipe": "blockwise"}
    ranks = gloo_pool2.run(measure, overrides, "learned_absolute", "fp8_blockwise", timeout=240)
    flags = BASE + ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    stage = stage_memory(build_config(parse_flags(flags), world=2))[0]
    for rank in ranks:
        assert abs(rank["activation_bytes"] / stage.act_per_microbatch - 1) < 0.10, rank
        assert rank["param_bytes"] == stage.param_bytes


LAYOUTS = ("Et|(tt|)*30L", "Ettt|(tt|)*29,m|L", "E|t*3|(t|)*2L")


def megatron_layouts(layouts: tuple[str, ...]) -> list[list[int]]:
    """Worker task: layers per stage as megatron-core parses each layout string."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    return [
        [len(stage) for stage in PipelineParallelLayerLayout.parse_str_to_list(text)]
        for text in layouts
    ]


def test_layout_grammar_matches_megatron(gloo_pool2) -> None:
    theirs = gloo_pool2.run(megatron_layouts, LAYOUTS, timeout=60)[0]
    assert [[len(stage) for stage in parse_layout(text)] for text in LAYOUTS] == theirs


def test_plan_matches_measured_memory_with_expert_parallelism(gloo_pool2) -> None:
    """EP=2 on 2 ranks: each rank holds 2 of 4 experts; dense ZeRO-1 over DP 2, experts over
    expert-DP 1. Routing decides each rank's expert tokens, so activations are compared summed."""
    ranks = gloo_pool2.run(measure, {}, "learned_absolute", None, 2, timeout=240)
    flags = BASE + ["--expert-model-parallel-size", "2"]
    stage = stage_memory(build_config(parse_flags(flags), world=2))[0]
    assert (
        stage.params.expert * 2 == stage_memory(build_config(parse_flags(BASE), 2))[0].params.expert
    )
    for rank in ranks:
        assert rank["params"] == stage.params.total
        assert rank["grad_bytes"] == stage.grad_bytes
    assert sum(r["optimizer_bytes"] for r in ranks) == 2 * stage.optimizer_bytes
    measured = sum(r["activation_bytes"] for r in ranks)
    assert abs(measured / (2 * stage.act_per_microbatch) - 1) < 0.10, measured
