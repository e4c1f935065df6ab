"""Which layers each pipeline rank holds: even split, first/last stage counts, or a layout string.

Virtual stage ``v`` runs on pipeline rank ``v % pp`` as model chunk ``v // pp`` (Megatron's
interleaved order). The embedding lives on the first virtual stage, the final norm and output
layer (and the loss) on the last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from titan_plugins.plan.config import PlanConfig
from titan_plugins.plan.flags import PlanError


@dataclass
class Chunk:
    """One model chunk (virtual stage) on a pipeline rank."""

    virtual_stage: int
    layers: list[int] = field(default_factory=list)
    embedding: bool = False
    head: bool = False


def parse_layout(layout: str) -> list[str]:
    """Expand a ``--pipeline-model-parallel-layout`` string into one string per virtual stage.

    Same grammar as megatron-core's ``PipelineParallelLayerLayout``: ``E`` embedding,
    ``t`` transformer layer, ``m`` MTP, ``L`` loss, ``|`` stage boundary, ``(..)*n`` and ``x*n``
    repetition, cosmetic commas.
    """
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for stage in stages:
        bad = set(stage) - set("EtmL")
        if bad:
            raise PlanError(
                f"--pipeline-model-parallel-layout: unknown layer character(s) "
                f"{sorted(bad)} in {layout!r} (use E, t, m, L, |, (..)*n)"
            )
    return stages


def _from_layout(cfg: PlanConfig) -> list[Chunk]:
    stages = parse_layout(cfg.layout)
    if len(stages) % cfg.pp:
        raise PlanError(
            f"--pipeline-model-parallel-layout has {len(stages)} stages, not a "
            f"multiple of --pipeline-model-parallel-size {cfg.pp}"
        )
    n_layers = sum(s.count("t") for s in stages)
    if n_layers != cfg.num_layers:
        raise PlanError(
            f"--pipeline-model-parallel-layout places {n_layers} transformer layers, "
            f"--num-layers is {cfg.num_layers}"
        )
    if any("m" in s for s in stages):
        raise PlanError("--pipeline-model-parallel-layout: MTP ('m') is not modelled by plan")
    if "E" not in stages[0] or "L" not in stages[-1]:
        raise PlanError("--pipeline-model-parallel-layout must start with E and end with L")
    chunks, nxt = [], 0
    for v, stage in enumerate(stages):
        count = stage.count("t")
        chunks.append(Chunk(v, list(range(nxt, nxt + count)), "E" in stage, "L" in stage))
        nxt += count
    return chunks


def _counts(cfg: PlanConfig) -> list[int]:
    stages = cfg.pp * cfg.vpp
    first, last = cfg.first_layers, cfg.last_layers
    if first is None and last is None:
        extra = int(cfg.account_embedding) + int(cfg.account_loss)
        total = cfg.num_layers + extra
        if total % stages:
            raise PlanError(
                f"--num-layers {cfg.num_layers}{' (+1 per accounted embedding/loss)' if extra else ''}"
                f" is not divisible by {stages} pipeline stages: set "
                f"--decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-layout"
            )
        per = total // stages
        counts = [per] * stages
        counts[0] -= int(cfg.account_embedding)
        counts[-1] -= int(cfg.account_loss)
        return counts
    if cfg.vpp > 1:
        raise PlanError(
            "--decoder-first/last-pipeline-num-layers with virtual stages: give "
            "--pipeline-model-parallel-layout instead (plan models that exactly)"
        )
    first = first if first is not None else 0
    last = last if last is not None else 0
    middle = cfg.pp - int(cfg.first_layers is not None) - int(cfg.last_layers is not None)
    rest = cfg.num_layers - first - last
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise PlanError(
            f"--decoder-first/last-pipeline-num-layers ({cfg.first_layers}, "
            f"{cfg.last_layers}) leave {rest} layers for {middle} middle stages"
        )
    per = rest // middle if middle else 0
    counts = [per] * cfg.pp
    if cfg.first_layers is not None:
        counts[0] = first
    if cfg.last_layers is not None:
        counts[-1] = last
    return counts


def pipeline_chunks(cfg: PlanConfig) -> list[list[Chunk]]:
    """Chunks per pipeline rank: ``result[rank]`` lists that rank's model chunks in order."""
    if cfg.layout:
        chunks = _from_layout(cfg)
    else:
        chunks, nxt = [], 0
        for v, count in enumerate(_counts(cfg)):
            chunks.append(Chunk(v, list(range(nxt, nxt + count))))
            nxt += count
        chunks[0].embedding = True
        chunks[-1].head = True
    vpp = len(chunks) // cfg.pp
    if cfg.layout and cfg.vpp not in (1, vpp):
        raise PlanError(
            f"--pipeline-model-parallel-layout gives {vpp} virtual stages per rank, "
            f"--num-virtual-stages-per-pipeline-rank says {cfg.vpp}"
        )
    cfg.vpp = vpp
    if vpp > 1 and cfg.num_microbatches < cfg.pp:
        raise PlanError(
            f"the interleaved schedule needs at least PP={cfg.pp} microbatches per step; "
            f"--global-batch-size {cfg.gbs} gives {cfg.num_microbatches} "
            f"(= GBS / (MBS {cfg.mbs} * DP {cfg.dp}))"
        )
    return [[chunks[c * cfg.pp + r] for c in range(vpp)] for r in range(cfg.pp)]
