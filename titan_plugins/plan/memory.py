"""Per-rank memory by pipeline stage: model states and in-flight activations under the schedule.

Model states: parameters, gradients (DDP main-grad buffer) and optimizer state (fp32 main params
when the model is 16-bit, Adam's two moments or SGD momentum), divided over data-parallel ranks
with the distributed optimizer (ZeRO-1): dense parameters over DP x CP, expert parameters over
expert DP. Padding of DDP buckets (< 64 elements per parameter, < lcm(DP, 128) per bucket) is
not modelled.

Activations: the schedule is simulated per pipeline rank with Megatron's warm-up counts (1F1B:
``pp - rank - 1``; interleaved: ``2 * (pp - rank - 1) + (vpp - 1) * pp``, +1 with EP A2A
overlap), forward units in Megatron's chunk order, so the peak counts each chunk's own
activations. Variants: as configured, ``fp8_blockwise`` storage, and ``act_offload`` (only the
``resident`` most recent units keep their offloadable tensors on the device: the forward in
progress and the unit prefetched for the next backward; the plugin never moves the pre-norm
inputs, the head, or tensors under 64 KiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_plugins.plan import activations as act
from titan_plugins.plan.config import PlanConfig
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


def _chunk_entries(cfg: PlanConfig, chunk: Chunk) -> list[act.Entry]:
    entries: list[act.Entry] = []
    if chunk.embedding:
        entries += act.embedding_entries(cfg)
    for layer in chunk.layers:
        entries += act.layer_entries(cfg, cfg.is_moe(layer))
    if chunk.head:
        entries += act.head_entries(cfg)
    return entries


# Saved outside the blocks act_offload wraps (attention, MLP/MoE): the pre-norms save their inputs.
_OUTSIDE_BLOCKS = {"attn_norm_input", "attn_norm_stats", "mlp_norm_input", "mlp_norm_stats"}
ACT_OFFLOAD_MIN_BYTES = 64 * 2**10  # TITAN_ACT_OFFLOAD_MIN_BYTES default: smaller tensors stay


def _offloadable(cfg: PlanConfig, entry: act.Entry, size: float) -> bool:
    """Whether act_offload moves this saved tensor to the host (per-tensor size threshold)."""
    if entry.module in ("embedding", "head") or entry.name in _OUTSIDE_BLOCKS:
        return False
    per_tensor = size / (cfg.experts // cfg.ep) if entry.name.startswith("expert_") else size
    return per_tensor >= ACT_OFFLOAD_MIN_BYTES


def _unit_bytes(cfg: PlanConfig, entries: list[act.Entry], fp8: bool) -> tuple[float, float]:
    """(device bytes, offloadable bytes) of one chunk for one microbatch."""
    megatron_off = set().union(*(_MEGATRON_OFFLOAD.get(m, set()) for m in cfg.offload_modules))
    total = offloadable = 0.0
    for e in entries:
        size = e.fp8_bytes() if fp8 else e.bytes
        if e.name in megatron_off:
            continue  # megatron's own offloading keeps these on the host
        total += size
        if _offloadable(cfg, e, size):
            offloadable += size
    return total, offloadable


def schedule_units(cfg: PlanConfig, rank: int, ep_overlap: bool = False) -> tuple[list, list, int]:
    """Forward and backward order of (chunk, microbatch) units on ``rank`` and the warm-up count."""
    nmb, vpp, pp = cfg.num_microbatches, cfg.vpp, cfg.pp
    total = nmb * vpp
    if pp == 1:
        warmup = 0
    elif vpp == 1:
        warmup = pp - rank - 1
    else:
        warmup = 2 * (pp - rank - 1) + (vpp - 1) * pp + int(ep_overlap)
    warmup = min(warmup, total)
    # Megatron's schedule table: microbatches in groups of ``pp`` (the last group takes the rest),
    # each group through every chunk in turn; backward runs the chunks in reverse.
    group = pp if vpp > 1 else 1
    table: list[tuple[int, int]] = []
    for start in range(0, nmb, group):
        end = nmb if start + group >= nmb else start + group
        table += [(chunk, mb) for chunk in range(vpp) for mb in range(start, end)]
    forward = table
    backward = [(vpp - 1 - chunk, mb) for chunk, mb in table]
    return forward, backward, warmup


def peak_activations(
    cfg: PlanConfig,
    units: list[tuple[float, float]],
    rank: int,
    resident: int | None,
    ep_overlap: bool = False,
) -> tuple[float, int]:
    """Peak device activation bytes on ``rank`` and the number of units alive at that peak.

    ``units[c]`` is (device bytes, offloadable bytes) of chunk ``c``; with ``resident`` set, all but
    the ``resident`` newest live units keep only their non-offloadable part on the device.
    """
    forward, backward, warmup = schedule_units(cfg, rank, ep_overlap)
    live: list[tuple[int, int]] = []
    peak, peak_count = 0.0, 0

    def device() -> float:
        total = 0.0
        for i, (chunk, _) in enumerate(live):
            full, off = units[chunk]
            newest = resident is None or i >= len(live) - resident
            total += full if newest else full - off
        return total

    steps = [("F", f) for f in forward[:warmup]]
    for k in range(len(forward) - warmup):
        steps += [("F", forward[warmup + k]), ("B", backward[k])]
    steps += [("B", b) for b in backward[len(forward) - warmup :]]
    for kind, u in steps:
        if kind == "F":
            live.append(u)
            now = device()
            if now > peak:
                peak, peak_count = now, len(live)
        else:
            live.remove(u)
    return peak, peak_count


def stage_memory(cfg: PlanConfig, resident: int = 2, ep_overlap: bool = False) -> list[StageMemory]:
    """Memory of every pipeline rank (rank 0 first)."""
    stages = []
    p_bytes = cfg.act_bytes
    for rank, chunks in enumerate(pipeline_chunks(cfg)):
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
            opt = per_param_state * (params.dense / (cfg.dp * cfg.cp) + params.expert / cfg.edp)
        else:
            opt = per_param_state * params.total
        entries = [_chunk_entries(cfg, c) for c in chunks]
        variants = {}
        fp8_default = cfg.fp8
        plain = [_unit_bytes(cfg, e, fp8_default) for e in entries]
        fp8 = [_unit_bytes(cfg, e, True) for e in entries]
        peak, count = peak_activations(cfg, plain, rank, None, ep_overlap)
        variants["configured"] = peak
        variants["fp8_blockwise"] = peak_activations(cfg, fp8, rank, None, ep_overlap)[0]
        variants["act_offload"] = peak_activations(cfg, plain, rank, resident, ep_overlap)[0]
        variants["fp8_blockwise+act_offload"] = peak_activations(
            cfg, fp8, rank, resident, ep_overlap
        )[0]
        stages.append(
            StageMemory(
                rank=rank,
                layers=[c.layers for c in chunks],
                params=params,
                param_bytes=params.total * p_bytes,
                grad_bytes=params.total * cfg.grad_bytes,
                optimizer_bytes=opt * (1 - cfg.opt_offload_fraction),
                optimizer_host_bytes=opt * cfg.opt_offload_fraction,
                act_per_microbatch=sum(u[0] for u in plain),
                in_flight=count,
                activations=variants,
            )
        )
    return stages
