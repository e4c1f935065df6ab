"""A tiny MoE GPT on unmodified megatron-core, trained through megatron's own schedules.

For tests of plugins on CPU/gloo (install ``cpu_harness`` first; the gloo worker pool does).
Typical task, run on every rank of a ``GlooWorkerPool``::

    tiny_gpt.init_parallel(ep=2)
    cfg = tiny_gpt.make_config()
    chunks = tiny_gpt.build_model(cfg)
    losses, grad_norms = tiny_gpt.train(chunks, cfg, steps=5)

Data: ``fixed_batches`` depends only on ``seed``, so every data-parallel rank sees the SAME
microbatches. That makes any layout (DP, EP, PP, VPP) mathematically the world-size-1 run, which
is what lets tests compare layouts and plugin-on vs plugin-off runs against one reference.
megatron is imported lazily (inside functions), so importing this module is cheap.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.hosts.megatron.testing.model_state import (
    global_state_dict,
    load_global_state_dict,
    state_snapshot,
)
from titan_plugins.hosts.megatron.testing.tiny_data import (
    MBS,
    SEQ,
    VOCAB,
    fixed_batches,
    forward_step,
)

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "MBS",
    "SEQ",
    "VOCAB",
    "build_model",
    "fixed_batches",
    "forward_step",
    "global_state_dict",
    "init_parallel",
    "load_global_state_dict",
    "make_config",
    "make_kimi_config",
    "MODELS",
    "ModelShape",
    "model_config",
    "make_optimizer",
    "state_snapshot",
    "train",
    "wrap_ddp",
]

PARALLEL_SEED = 1234  # seed given to model_parallel_cuda_manual_seed: fixes the initial weights


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, vpp: int | None = None) -> None:
    """(Re)create megatron's model-parallel state on the existing torch.distributed world.

    Switches megatron's parallel state to this layout (its groups are created the first time a
    worker uses the layout and reused after, see ``_use_layout``) and resets the RNG tracker and
    per-run globals, so tasks sharing a long-lived worker do not see each other's state; then
    seeds megatron's RNGs
    (``model_parallel_cuda_manual_seed(1234)``), which makes the initial weights a function of the
    layout only. The gloo world group itself is left alone.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "init_parallel needs torch.distributed initialised: run the task in a "
            "titan_plugins.testing.workers.GlooWorkerPool (or call init_process_group('gloo'))."
        )
    mrandom.get_cuda_rng_tracker().reset()
    _reset_run_globals()
    _use_layout(ps, (tp, pp, ep, vpp))
    mrandom.model_parallel_cuda_manual_seed(PARALLEL_SEED)


_PRISTINE: dict[str, Any] = {}
_LAYOUTS: dict[tuple, dict[str, Any]] = {}


def _parallel_globals(ps: Any) -> dict[str, Any]:
    """megatron's model-parallel state: the module's ``_UPPER_CASE`` globals."""
    return {
        k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper() and k.isupper()
    }


def _use_layout(ps: Any, key: tuple) -> None:
    """Switch megatron to the groups of layout ``key``, creating them only the first time.

    Groups are never destroyed: megatron's ``destroy_model_parallel`` frees some gloo groups
    on one rank while the peers still hold theirs, and a gloo group whose peer closed its
    sockets busy-loops its I/O thread. Long-lived workers would pile up thousands of such
    threads. Each layout's groups are created once per worker and restored afterwards.
    """
    tp, pp, ep, vpp = key
    if not _PRISTINE:
        if ps.model_parallel_is_initialized():  # set up by someone else: start from scratch
            ps.destroy_model_parallel()
        _PRISTINE.update(_parallel_globals(ps))
    cached = _LAYOUTS.get(key)
    if cached is None:
        vars(ps).update(_PRISTINE)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
        )
        cached = _LAYOUTS[key] = _parallel_globals(ps)
    vars(ps).update(cached)


def _reset_run_globals() -> None:
    """Forget megatron's process-global per-run state left by an earlier task in this worker."""
    from megatron.core.transformer.moe import moe_utils

    # The MoE aux-loss tracker sizes its tensors by the first model's layer count: a deeper model
    # later in the worker would index past them. Up to 0.17 it is moe_utils' global dict; from
    # 0.18 a MoEMetricsTracker in moe_logging (moe_utils then returns a fresh dict view of it,
    # whose clear() forgets nothing), dropped with destroy_moe_metrics_tracker(). moe_utils
    # imports moe_logging where it exists, so sys.modules tells the line apart.
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if moe_logging is not None:
        moe_logging.destroy_moe_metrics_tracker()
    else:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    # A backward outside megatron's schedules leaves a 0-d scale here; the next schedule run
    # then fails to broadcast it ("output with shape [] doesn't match ... [1]").
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    offload = sys.modules.get("megatron.core.pipeline_parallel.fine_grained_activation_offload")
    if offload is not None:  # the activation-offload manager is a singleton holding chunk state
        offload.PipelineOffloadManager.OFFLOAD_MGR = None


def make_config(**overrides: Any) -> TransformerConfig:
    """A tiny MoE GPT ``TransformerConfig`` for the current parallel layout; ``overrides`` win.

    2 layers (or one per virtual stage when that is more), hidden 64, 4 heads, ffn 128,
    4 experts top-2 with the alltoall dispatcher, fp32, dropout 0, CPU initialisation, no linear
    biases; ``bf16=True`` / ``fp16=True`` also set ``params_dtype`` (and PP's ``pipeline_dtype``). Parallel sizes come from ``init_parallel``. ``num_moe_experts=None`` gives a dense model.
    P2P settings stay megatron's defaults on purpose (the harness does not fix upstream bugs): PP=2
    with VPP and ``batch_p2p_comm=True`` (the default) silently swaps activations and gradients,
    so interleaved tests without a P2P fix pass ``batch_p2p_comm=False``.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**_config_fields(overrides))


def _config_fields(overrides: dict[str, Any]) -> dict[str, Any]:
    """``make_config``'s fields for the current layout, ``overrides`` applied."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    fields: dict[str, Any] = dict(
        num_layers=max(2, _pipeline_layers()),
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        add_bias_linear=False,
        bf16=False,
        params_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
    )
    fields.update(overrides)
    if "params_dtype" not in overrides and (fields["bf16"] or fields.get("fp16")):
        # As megatron.training derives it: half-precision runs keep their weights in that dtype.
        fields["params_dtype"] = torch.bfloat16 if fields["bf16"] else torch.float16
    if pp > 1 and "pipeline_dtype" not in overrides:
        fields["pipeline_dtype"] = fields["params_dtype"]  # P2P buffers are allocated in it
    if fields.get("num_moe_experts") is None:
        # Dense model: the MoE-only fields would fail TransformerConfig validation.
        for key in ("moe_router_topk", "moe_token_dispatcher_type", "moe_aux_loss_coeff"):
            if key not in overrides:
                fields.pop(key)
    return fields


def make_kimi_config(**overrides: Any) -> TransformerConfig:
    """Kimi-K2's (and DeepSeek-V3's) architecture at tiny size, as an ``MLATransformerConfig``.

    Multi-latent attention (query LoRA 32, key/value LoRA 16, query/key head 16 + 8 rope, value
    head 12, YaRN rope), 4 layers of which the first is dense (``moe_layer_freq``), 4 routed
    experts top-2 plus one shared expert, a sigmoid router with the aux-loss-free expert bias and
    group-limited routing (2 groups, top-1 group), RMSNorm and SwiGLU; the rest as
    ``make_config`` (parallel sizes from ``init_parallel``, fp32, CPU initialisation). Build it
    with ``build_model(cfg, **MODELS["kimi"].gpt_kwargs)`` (no absolute positions, an untied
    output layer); ``build_model`` puts the CPU core attention into the MLA layers.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    layers = max(4, _pipeline_layers())
    fields: dict[str, Any] = dict(
        num_layers=layers,
        moe_layer_freq=[0] + [1] * (layers - 1),
        moe_ffn_hidden_size=64,
        moe_shared_expert_intermediate_size=64,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_aux_loss_coeff=0.0,  # aux-loss-free: the expert bias balances the load
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        rope_type="yarn",
    )
    fields.update(overrides)
    return MLATransformerConfig(**_config_fields(fields))


@dataclass(frozen=True)
class ModelShape:
    """A model shape: the maker of its config and what ``build_model`` passes to ``GPTModel``."""

    config: Callable[..., TransformerConfig]
    gpt_kwargs: dict[str, Any]


MODELS: dict[str, ModelShape] = {
    "gpt": ModelShape(make_config, {}),
    # Kimi-K2: rotary positions only (MLA applies them), an untied output layer
    "kimi": ModelShape(
        make_kimi_config,
        {"position_embedding_type": "rope", "share_embeddings_and_output_weights": False},
    ),
}
"""The model shapes by name (the demo's ``--model``, verify's layouts): build one with
``build_model(model_config(name, ...), **MODELS[name].gpt_kwargs)``."""


def model_config(model: str, **overrides: Any) -> TransformerConfig:
    """The config of model shape ``model`` (a key of ``MODELS``), ``overrides`` applied.

    :raises ValueError: an unknown shape.
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; models: {', '.join(MODELS)}")
    return MODELS[model].config(**overrides)


def _pipeline_layers() -> int:
    """Layers one per (virtual) pipeline stage of the current layout."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return pp * (vpp or 1)


def build_model(
    cfg: TransformerConfig, vpp: int | None = None, ddp: bool = True, **gpt_kwargs: Any
) -> list:
    """Build the GPT model chunks of this rank (one per virtual pipeline stage).

    Each chunk gets the right ``pre_process`` / ``post_process`` for its (virtual) stage. With
    ``ddp=True`` chunks are wrapped in megatron's DistributedDataParallel (``Float16Module`` first
    when ``cfg.bf16`` / ``cfg.fp16``); ``ddp=False`` returns bare ``GPTModel``s (e.g. to load
    weights before wrapping with ``wrap_ddp``). ``vpp`` defaults to the config's virtual size.
    ``gpt_kwargs`` go to ``GPTModel`` (e.g. ``position_embedding_type="rope"``,
    ``share_embeddings_and_output_weights=False`` for a Llama-style model, with
    ``make_config(normalization="RMSNorm", gated_linear_unit=True, ...)``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    vpp = vpp or cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for index in range(vpp or 1):
        vp_stage = index if vpp else None
        chunks.append(
            GPTModel(
                cfg,
                _layer_spec(cfg, vp_stage),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                **gpt_kwargs,
            )
        )
    return wrap_ddp(chunks, cfg) if ddp else chunks


def _layer_spec(cfg: TransformerConfig, vp_stage: int | None) -> Any:
    """megatron's local (non-TE) spec for ``cfg``: one layer spec for a uniform MoE GPT; for MLA
    or mixed dense / MoE layers megatron's block spec (one spec per layer of this stage), with
    the CPU core attention in the MLA layers."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if cfg.multi_latent_attention or cfg.moe_layer_freq != 1:
        from titan_plugins.hosts.megatron.testing.mla_attention import with_mla_core_attention

        return with_mla_core_attention(
            get_gpt_decoder_block_spec(
                cfg,
                use_transformer_engine=False,
                normalization=cfg.normalization,
                vp_stage=vp_stage,
            )
        )
    if cfg.normalization == "LayerNorm":
        return get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts)
    return get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts, normalization=cfg.normalization
    )


def wrap_ddp(chunks: list, cfg: TransformerConfig) -> list:
    """Wrap bare model chunks in megatron DDP (and ``Float16Module`` for bf16/fp16 configs)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    half = bool(cfg.bf16 or cfg.fp16)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=half, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        module = Float16Module(cfg, chunk) if half else chunk
        # Bucketing only for the first chunk, as megatron.training does for virtual stages.
        wrapped.append(
            DistributedDataParallel(cfg, ddp_config, module, disable_bucketing=index > 0)
        )
    return wrapped


def make_optimizer(chunks: list, cfg: TransformerConfig, lr: float = 1e-3) -> Any:
    """megatron's Adam (``get_megatron_optimizer``) with grad clipping at 1.0, matching ``cfg``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        bf16=bool(cfg.bf16),
        fp16=bool(cfg.fp16),
        params_dtype=cfg.params_dtype,
        use_distributed_optimizer=False,
        clip_grad=1.0,
    )
    return get_megatron_optimizer(config, chunks)


class RepeatingBatches:
    """The data iterator of :func:`train`: endless, the same ``batches`` in the same order step
    after step, from one iterator kept across steps (as a real loop's data iterator is), so a
    caller that skips whole steps of microbatches between steps (rewind's escalation) really
    advances it. ``consumed`` counts the microbatches read (by the schedule or a skip)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.consumed = 0

    def __iter__(self) -> RepeatingBatches:
        return self

    def __next__(self) -> Any:
        batch = self.batches[self.consumed % len(self.batches)]
        self.consumed += 1
        return batch


def train(
    chunks: list,
    cfg: TransformerConfig,
    steps: int,
    num_microbatches: int = 2,
    seed: int = 0,
    lr: float = 1e-3,
    optimizer: Any = None,
) -> tuple[list[float], list[float]]:
    """Train ``steps`` steps on ``fixed_batches(num_microbatches, seed)`` (the same data each step,
    from one ``RepeatingBatches`` iterator per chunk kept across the steps).

    Uses ``get_forward_backward_func()`` (so PP/VPP/EP-overlap pick megatron's matching schedule),
    megatron's ``finalize_model_grads`` (DP/EP grad reduction, tied-embedding sync) and a fresh
    ``make_optimizer(chunks, cfg, lr)`` unless ``optimizer`` is given.
    Returns ``(losses, grad_norms)``: the per-token LM loss of each step on the last pipeline stage
    (``[]`` elsewhere) and the global grad norm of each step (on every rank).
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    if cfg.finalize_model_grads_func is None:
        cfg.finalize_model_grads_func = finalize_model_grads
    optimizer = optimizer or make_optimizer(chunks, cfg, lr)
    forward_backward = get_forward_backward_func()
    batches = fixed_batches(num_microbatches, seed)
    # One iterator per chunk (each virtual stage consumes every microbatch once per step), kept
    # across steps: each step reads the same microbatches, and a skip between steps is real.
    iterators = [RepeatingBatches(batches) for _ in chunks]
    losses: list[float] = []
    grad_norms: list[float] = []
    for _ in range(steps):
        clear_aux_losses_tracker()  # per step, as megatron.training's MoE metric logging does
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = _run_schedule(forward_backward, chunks, iterators, num_microbatches, False)
        _, grad_norm, _ = optimizer.step()
        grad_norms.append(float(grad_norm))
        if outputs:  # only the last pipeline stage gets the loss reports
            total = torch.stack([out["lm loss"] for out in outputs]).sum(0)
            losses.append((total[0] / total[1]).item())
    return losses, grad_norms


def _run_schedule(
    forward_backward: Any, chunks: list, iterators: list, num_microbatches: int, forward_only: bool
) -> list:
    """One call of megatron's schedule over the tiny GPT: a list of chunks and of iterators only
    when there are several virtual stages, as megatron expects."""
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
    )


def evaluate(
    chunks: list, cfg: TransformerConfig, num_microbatches: int = 2, seed: int = 0
) -> float:
    """One forward-only pass over ``fixed_batches(num_microbatches, seed)``: the per-token LM loss
    on the last pipeline stage (``nan`` elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = fixed_batches(num_microbatches, seed)
    iterators = [iter(batches) for _ in chunks]
    with torch.no_grad():
        outputs = _run_schedule(
            get_forward_backward_func(), chunks, iterators, num_microbatches, True
        )
    if not outputs:
        return None
    total = torch.stack([out["lm loss"] for out in outputs]).sum(0)
    return (total[0] / total[1]).item()
