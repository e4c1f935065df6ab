"""Per-rank memory by pipeline stage: model states and in-flight activations under the schedule.

Model states: parameters, gradients (DDP main-grad buffer) and optimizer state (fp32 main params
when the model is 16-bit, Adam's two moments or SGD momentum), divided over data-parallel ranks
with the distributed optimizer (ZeRO-1): dense parameters over DP x CP, expert parameters over
expert DP. Padding of DDP buckets (< 64 elements per parameter, < lcm(DP, 128) per bucket) is
not modelled.

Activations: each rank's events come from the core's model of Megatron's schedule order
(:mod:`titan_plugins.hosts.megatron.schedule`: warm-up, steady 1F1B, cool-down per chunk and
microbatch), and
the peak counts each chunk's own activations at every forward. Variants: as configured, and
what each installed plugin says it does (``titan_memory_effect``, :mod:`.effects`), alone and
all together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from titan_plugins.hosts.megatron.schedule import (
    FORWARD,
    INTERLEAVED,
    ONE_F_ONE_B,
    Schedule,
    pipeline_schedule,
    replay,
    schedule_kind,
)
from titan_plugins.plan import activations as act
from titan_plugins.plan.config import PlanConfig
from titan_plugins.plan.effects import MemoryEffect, MemoryLayout, Variant, ask_plugins, variants
from titan_plugins.plan.flags import PlanError
from titan_plugins.plan.layout import Chunk, pipeline_chunks
from titan_plugins.plan.params import Params, embedding_params, head_params, layer_params

# Megatron --offload-modules names -> the saved tensors they move off the device.
_MEGATRON_OFFLOAD = {
    "attn_norm": {"attn_norm_input"},
    "qkv_linear": {"attn_norm_output"},
    "core_attn": {"q_k_v"},
    "attn_proj": {"attn_proj_input"},
    "mlp_norm": {"mlp_norm_input"},
    "expert_fc1": {"expert_fc1_input"},
    "moe_act": {"expert_fc1_output"},
}


@dataclass
class StageMemory:
    """Memory of one pipeline rank, bytes."""

    rank: int
    layers: list[list[int]]
    params: Params
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    optimizer_host_bytes: float
    act_per_microbatch: float  # all chunks of this rank, one microbatch, as configured
    in_flight: int  # chunk-microbatch units alive at the peak
    activations: dict[str, float] = field(default_factory=dict)  # variant -> peak bytes

    @property
    def states(self) -> float:
        """Parameters + gradients + device-resident optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _chunk_entries(cfg: PlanConfig, chunk: Chunk) -> list[list[act.Entry]]:
    """A chunk's saved tensors for one microbatch, by group: embedding, each layer, head."""
    groups = [act.embedding_entries(cfg)] if chunk.embedding else []
    groups += [act.layer_entries(cfg, cfg.is_moe(layer)) for layer in chunk.layers]
    return groups + ([act.head_entries(cfg)] if chunk.head else [])


def stage_schedule(cfg: PlanConfig, rank: int) -> Schedule:
    """The order megatron runs units on pipeline ``rank`` (``cfg.vpp`` as the layout set it).

    EP A2A overlap changes the order only under the interleaved schedule (one more warm-up
    forward). At PP=1 megatron's combined step interleaves the next forward with the previous
    backward layer by layer, about one unit plus one layer alive: modelled as one unit.
    """
    kind = schedule_kind(cfg.pp, cfg.vpp)
    if cfg.ep_overlap and kind == ONE_F_ONE_B:
        raise PlanError(
            "--overlap-moe-expert-parallel-comm with --pipeline-model-parallel-size > 1 needs "
            "virtual stages (--num-virtual-stages-per-pipeline-rank), as megatron-core asserts"
        )
    try:
        return pipeline_schedule(
            kind,
            cfg.pp,
            rank,
            cfg.num_microbatches,
            cfg.vpp,
            cfg.vp_group,
            ep_overlap=cfg.ep_overlap and kind == INTERLEAVED,
        )
    except ValueError as err:  # a layout megatron refuses: name the flags that set it
        raise PlanError(
            f"{err}; microbatches = --global-batch-size {cfg.gbs} / (MBS {cfg.mbs} * DP "
            f"{cfg.dp}), group size = --microbatch-group-size-per-virtual-pipeline-stage "
            f"(default PP)"
        ) from None


def peak_activations(
    schedule: Schedule, units: Sequence[tuple[float, float]], resident: int | None
) -> tuple[float, int]:
    """Peak device activation bytes over ``schedule`` and the number of units alive at it.

    ``units[c]`` is (device bytes, offloadable bytes) of chunk ``c``; with ``resident`` set, all
    but the ``resident`` newest live units keep only their non-offloadable part on the device.
    """
    peak, peak_count = 0.0, 0
    for event, live in replay(schedule.events):
        if event.kind != FORWARD:
            continue
        now = 0.0
        for i, unit in enumerate(live):
            full, off = units[unit.chunk]
            newest = resident is None or i >= len(live) - resident
            now += full if newest else full - off
        if now > peak:
            peak, peak_count = now, len(live)
    return peak, peak_count


def _states(cfg: PlanConfig, chunks: list[Chunk]) -> tuple[Params, float]:
    """Parameters of a rank's chunks and their optimizer-state bytes."""
    params = Params()
    for chunk in chunks:
        for layer in chunk.layers:
            params = params + layer_params(cfg, layer)
        if chunk.embedding:
            params = params + Params(embedding_params(cfg))
        if chunk.head:
            params = params + Params(head_params(cfg))
    per_param_state = (cfg.main_param_bytes if cfg.param_dtype != "fp32" else 0) + (
        cfg.exp_avg_bytes + cfg.exp_avg_sq_bytes if cfg.optimizer == "adam" else 4
    )
    if cfg.dist_opt:
        return params, per_param_state * (
            params.dense / (cfg.dp * cfg.cp) + params.expert / cfg.edp
        )
    return params, per_param_state * params.total


def stage_memory(
    cfg: PlanConfig, resident: int = 1, effects: Sequence[MemoryEffect] | None = None
) -> list[StageMemory]:
    """Memory of every pipeline rank (rank 0 first).

    :param resident: ``plan --act-offload-resident``, passed to the plugins in the layout.
    :param effects: the plugins' memory effects; None asks the installed plugins.
    """
    chunks_by_rank = pipeline_chunks(cfg)  # settles cfg.vpp from a layout string
    if effects is None:
        effects = ask_plugins(MemoryLayout(cfg, resident))
    shown: list[Variant] = variants(effects)
    dropped = set().union(*(_MEGATRON_OFFLOAD.get(m, set()) for m in cfg.offload_modules))
    stages = []
    for rank, chunks in enumerate(chunks_by_rank):
        params, opt = _states(cfg, chunks)
        entries = [_chunk_entries(cfg, c) for c in chunks]
        schedule = stage_schedule(cfg, rank)
        peaks: dict[str, float] = {}
        per_microbatch, in_flight = 0.0, 0
        for variant in shown:
            units = [variant.unit_bytes(e, cfg.fp8, dropped) for e in entries]
            peaks[variant.name], count = peak_activations(schedule, units, variant.resident_units)
            if variant.name == "configured":
                per_microbatch, in_flight = sum(u[0] for u in units), count
        stages.append(
            StageMemory(
                rank=rank,
                layers=[c.layers for c in chunks],
                params=params,
                param_bytes=params.total * cfg.act_bytes,
                grad_bytes=params.total * cfg.grad_bytes,
                optimizer_bytes=opt * (1 - cfg.opt_offload_fraction),
                optimizer_host_bytes=opt * cfg.opt_offload_fraction,
                act_per_microbatch=per_microbatch,
                in_flight=in_flight,
                activations=peaks,
            )
        )
    return stages
