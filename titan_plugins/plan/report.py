"""Turn a plan into a dict (the JSON output) and into text; decide fit and what to switch on."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from titan_plugins.plan.config import PlanConfig
from titan_plugins.plan.effects import MemoryEffect, MemoryLayout, Variant, ask_plugins, variants
from titan_plugins.plan.flops import flops_per_step, mfu
from titan_plugins.plan.memory import StageMemory, stage_memory
from titan_plugins.plan.params import total_params

GIB = 2**30


def switch_text(variant: Variant) -> str:
    """How to turn a variant on, for the advice (one plugin, or all of its plugins)."""
    effects = variant.effects
    if len(effects) == 1:
        (e,) = effects
        return f"{e.switch}{' with ' + e.flags if e.flags else ''} ({e.description})"
    parts = [f"{e.switch}{' (+ ' + e.flags + ')' if e.flags else ''}" for e in effects]
    joined = " and ".join([", ".join(parts[:-1]), parts[-1]])
    return f"{'both' if len(parts) == 2 else 'all of'} {joined}"


def _peak(stage: StageMemory, variant: str) -> float:
    return stage.states + stage.activations[variant]


def _worst(cfg: PlanConfig, **change: Any) -> float:
    """The worst stage's configured peak with Megatron settings changed (plugins play no part)."""
    alt = copy.copy(cfg)
    for key, value in change.items():
        setattr(alt, key, value)
    return max(_peak(s, "configured") for s in stage_memory(alt, effects=()))


def _advice(
    cfg: PlanConfig, stages: list[StageMemory], budget: float, shown: Sequence[Variant]
) -> list[str]:
    """What to switch on, cheapest first, with the worst stage's peak it gives."""
    options: list[tuple[str, float]] = []
    configured = max(_peak(s, "configured") for s in stages)
    for variant in shown[1:]:
        worst = max(_peak(s, variant.name) for s in stages)
        if worst >= configured:
            continue  # already in effect (e.g. fp8 flags given): nothing to switch on
        options.append((switch_text(variant), worst))
        if worst <= budget:
            break
    if not cfg.dist_opt and cfg.dp > 1:
        options.append(
            (
                f"--use-distributed-optimizer (ZeRO-1 over DP {cfg.dp})",
                _worst(cfg, dist_opt=True),
            )
        )
    if cfg.opt_offload_fraction < 1:
        options.append(
            (
                "--optimizer-cpu-offload --optimizer-offload-fraction 1.0",
                _worst(cfg, opt_offload_fraction=1.0),
            )
        )
    if cfg.recompute_granularity != "full":
        options.append(
            (
                "--recompute-granularity full (recomputes every layer)",
                _worst(cfg, recompute_granularity="full"),
            )
        )
    tips = [f"{text}: worst stage {worst / GIB:.1f} GiB" for text, worst in options]
    if all(worst > budget for _, worst in options):
        tips.append(
            "none of these alone fits: combine them, or use more pipeline stages, wider "
            "expert parallelism, or more GPUs (expert DP shards the ZeRO-1 state)"
        )
    return tips


def build_report(
    cfg: PlanConfig,
    device_bytes: float | None = None,
    reserve: float = 0.1,
    step_time: float | None = None,
    peak_tflops: float | None = None,
    resident: int = 1,
    effects: Sequence[MemoryEffect] | None = None,
) -> dict[str, Any]:
    """The whole plan as plain data (what ``--json`` prints).

    :param resident: ``--act-offload-resident``, handed to the plugins in the layout.
    :param effects: the plugins' memory effects; None asks the installed plugins.
    """
    if effects is None:
        effects = ask_plugins(MemoryLayout(cfg, resident))
    shown = variants(effects)
    names = [v.name for v in shown]
    stages = stage_memory(cfg, resident, effects)
    total, active = total_params(cfg)
    flops = flops_per_step(cfg)
    out: dict[str, Any] = {
        "model": {
            "params_total": total,
            "params_active": active,
            "layers": cfg.num_layers,
            "moe_layers": sum(cfg.is_moe(i) for i in range(cfg.num_layers)),
            "vocab_padded": cfg.vocab,
        },
        "parallel": {
            "world": cfg.world,
            "tp": cfg.tp,
            "pp": cfg.pp,
            "vpp": cfg.vpp,
            "ep": cfg.ep,
            "etp": cfg.etp,
            "cp": cfg.cp,
            "dp": cfg.dp,
            "expert_dp": cfg.edp,
            "microbatches": cfg.num_microbatches,
            "distributed_optimizer": cfg.dist_opt,
        },
        "stages": [
            {
                "rank": s.rank,
                "layers": s.layers,
                "params": s.params.total,
                "params_expert": s.params.expert,
                "param_bytes": s.param_bytes,
                "grad_bytes": s.grad_bytes,
                "optimizer_bytes": s.optimizer_bytes,
                "optimizer_host_bytes": s.optimizer_host_bytes,
                "states_bytes": s.states,
                "activation_bytes_per_microbatch": s.act_per_microbatch,
                "in_flight_units": s.in_flight,
                "activation_peak_bytes": dict(s.activations),
                "peak_bytes": {v: _peak(s, v) for v in names},
            }
            for s in stages
        ],
        "flops_per_step": flops,
        "act_offload_resident_units": resident,
        "variants": [
            {"name": v.name, "label": v.label, "legend": v.legend, "switch": switch_text(v)}
            for v in shown[1:]
        ],
    }
    if step_time and peak_tflops:
        out["mfu"] = mfu(cfg, step_time, peak_tflops)
        out["step_time_s"], out["peak_tflops"] = step_time, peak_tflops
    if device_bytes:
        budget = device_bytes * (1 - reserve)
        worst = max(_peak(s, "configured") for s in stages)
        out["device_bytes"], out["budget_bytes"] = device_bytes, budget
        out["fits"] = worst <= budget
        out["fits_with"] = {v: max(_peak(s, v) for s in stages) <= budget for v in names}
        out["advice"] = [] if out["fits"] else _advice(cfg, stages, budget, shown)
    return out


def _layers_text(layers: list[list[int]]) -> str:
    parts = []
    for chunk in layers:
        parts.append(
            f"{chunk[0]}-{chunk[-1]}" if len(chunk) > 1 else (str(chunk[0]) if chunk else "-")
        )
    return ",".join(parts)


def _count(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(int(n))


def render_text(rep: dict[str, Any]) -> str:
    """Human-readable plan: a header, one row per pipeline rank, FLOPs/MFU, fit and advice."""
    m, p = rep["model"], rep["parallel"]
    biggest = max(s["peak_bytes"]["configured"] for s in rep["stages"])
    unit, scale = ("GiB", GIB) if biggest >= GIB / 8 else ("MiB", 2**20)
    shown = rep["variants"]
    names = ["configured"] + [v["name"] for v in shown]
    legend = ""
    if shown:
        legend = (
            f"; {' / '.join(v['label'] for v in shown)}: with "
            f"{', '.join(v['legend'] for v in shown)}"
        )
    lines = [
        f"model: {_count(m['params_total'])} parameters ({_count(m['params_active'])} "
        f"active), {m['layers']} layers ({m['moe_layers']} MoE), vocab {m['vocab_padded']}",
        f"layout: {p['world']} GPUs = TP{p['tp']} x PP{p['pp']} (VPP{p['vpp']}) x CP{p['cp']} x "
        f"DP{p['dp']}; experts EP{p['ep']} x ETP{p['etp']} x expert-DP{p['expert_dp']}; "
        f"{p['microbatches']} microbatches/step; distributed optimizer "
        f"{'on' if p['distributed_optimizer'] else 'off'}",
        f"memory per GPU ({unit}) by pipeline rank; act = peak over the schedule of the "
        f"in-flight units (chunk x microbatch){legend}",
        f"{'rank':>4} {'layers':>12} {'params':>8} {'param':>7} {'grad':>7} {'optim':>7} "
        f"{'states':>7} {'act/mb':>7} {'units':>5} {'act':>7} "
        + "".join(f"{v['label']:>7} " for v in shown)
        + f"{'peak':>7}",
    ]
    for s in rep["stages"]:
        a = s["activation_peak_bytes"]
        lines.append(
            f"{s['rank']:>4} {_layers_text(s['layers']):>12} {_count(s['params']):>8} "
            f"{s['param_bytes'] / scale:>7.1f} {s['grad_bytes'] / scale:>7.1f} "
            f"{s['optimizer_bytes'] / scale:>7.1f} {s['states_bytes'] / scale:>7.1f} "
            f"{s['activation_bytes_per_microbatch'] / scale:>7.2f} {s['in_flight_units']:>5} "
            + " ".join(f"{a[v] / scale:>7.1f}" for v in names)
            + f" {s['peak_bytes']['configured'] / scale:>7.1f}"
        )
    lines.append(f"FLOPs per step: {rep['flops_per_step']:.4g} (model FLOPs, Megatron accounting)")
    if "mfu" in rep:
        lines.append(
            f"MFU at {rep['step_time_s']} s/step and {rep['peak_tflops']} TFLOP/s peak: "
            f"{rep['mfu'] * 100:.1f}%"
        )
    if "fits" in rep:
        lines.append(
            f"device {rep['device_bytes'] / GIB:.0f} GiB, budget {rep['budget_bytes'] / GIB:.1f}"
            f" GiB: {'fits' if rep['fits'] else 'does NOT fit'} as configured; "
            + ", ".join(f"{v}: {'fits' if ok else 'no'}" for v, ok in rep["fits_with"].items())
        )
        for tip in rep["advice"]:
            lines.append(f"  switch on: {tip}")
    return "\n".join(lines)
