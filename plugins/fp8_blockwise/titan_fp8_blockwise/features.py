"""All there or not at all: which patches each feature needs, and whether this process has them.

A feature runs only when every patch it needs is in place. If one of them was not applied on
the imported Megatron (skipped by its signature, failed, or written for another line with no
variant for this one), the feature stands aside: megatron's own code runs instead of a half
patched path (e.g. FP8 attention projections with high-precision MLPs, or FP8 weights that are
never re-quantized because the step boundary is not seen), and the report and effects say so.

A *slot* is a tuple of alternative records (the variants of one patch per Megatron line): it is
filled when one of them is applied, open while none has been judged yet (its module has not
been imported: nothing of it can run either), and missing when none applied and none is still
pending. Only missing slots make a feature inactive.

Light (no torch, no megatron): the patched functions ask on every call.
"""

from __future__ import annotations

from typing import Any

from titan_fp8_blockwise import effects
from titan_plugins.patching import APPLIED, PENDING

P = "fp8_blockwise."
LINEAR = "linear"
SWIGLU_STORE = "swiglu_store"
RECOMPUTE = "recompute"
MOE_CONFIG = "moe_config"

FEATURES: dict[str, tuple[tuple[str, ...], ...]] = {
    # The FP8 regions, both linear classes (one variant each), and the weight cache's step
    # boundary: the core's train-step patches, which fire titan_train_step (see weight_cache).
    LINEAR: (
        (P + "get_fp8_context",),
        (P + "ColumnParallelLinear", P + "ColumnParallelLinear.gtp"),
        (P + "RowParallelLinear", P + "RowParallelLinear.gtp"),
    ),
    # Dense and MoE SwiGLU experts store their input the same way, or neither does.
    SWIGLU_STORE: ((P + "bias_swiglu_impl",), (P + "weighted_bias_swiglu_impl",)),
    # Every place megatron recomputes an fp8 model through te_checkpoint (the block's call moved
    # to megatron/core/recompute.py in 0.18).
    RECOMPUTE: (
        (P + "te_checkpoint.transformer_engine",),
        (P + "te_checkpoint.transformer_block", P + "te_checkpoint.recompute"),
        (P + "te_checkpoint.moe_layer",),
    ),
    MOE_CONFIG: ((P + "te_version_check",),),
}
CORE_STEP_PREFIX = "core.train_step."  # the core's records that fire titan_train_step
NEEDED_BY = {LINEAR: "the FP8 linear layers", SWIGLU_STORE: "the blockwise-FP8 SwiGLU store"}
NEEDED_BY |= {RECOMPUTE: "recomputation in FP8", MOE_CONFIG: "MoE + FP8 configs without TE"}


def track(records: list[Any]) -> None:
    """Remember the records the plugin registered (the engine updates their status in place)."""
    effects.track(records)


def _core_step_records() -> list[Any]:
    from titan_plugins import activation

    state = activation.current()
    engine = getattr(state, "engine", None) if state is not None else None
    if engine is None:
        return []
    return [p for p in engine.patches() if p.id.startswith(CORE_STEP_PREFIX)]


def _slot_problem(slot: tuple[str, ...], records: dict[str, Any]) -> tuple[str, str] | None:
    """None when the slot is filled or still open; else (its records, what became of each)."""
    mine = [records[name] for name in slot if name in records]
    if any(r.status in (APPLIED, PENDING) for r in mine):
        return None
    names = " / ".join(slot)
    if not mine:
        return names, f"{names} not registered"
    return names, "; ".join(
        f"{r.id} {r.status}" + (f" ({r.detail})" if r.detail else "") for r in mine
    )


def missing(feature: str) -> list[tuple[str, str]]:
    """What keeps ``feature`` from running in this process: (records, what became of them) per
    missing slot; empty: it may run.

    Nothing is judged before the plugin registered its records (no activation: unit tests of
    the layers themselves). The SwiGLU store and recomputation in FP8 also need the FP8 linear
    layers: they only run inside the FP8 regions those open.
    """
    _records = effects.REGISTERED
    if not _records:
        return []
    problems = [p for slot in FEATURES[feature] if (p := _slot_problem(slot, _records))]
    if feature in (SWIGLU_STORE, RECOMPUTE):
        problems += missing(LINEAR)
    if feature == LINEAR:
        for record in _core_step_records():
            problem = _slot_problem((record.id,), {record.id: record})
            problems += [problem] if problem else []
    return problems


def inactive_reason(feature: str = LINEAR) -> str | None:
    """One sentence saying why ``feature`` stands aside, or None when it may run."""
    problems = missing(feature)
    if not problems:
        return None
    return (
        f"stepped aside ({NEEDED_BY[feature]}): patches not applied on this Megatron: "
        f"{'; '.join(detail for _, detail in problems)}. Megatron's own code runs there instead "
        "(TE's when installed, else high precision); `titan-plugins list --import-targets` "
        "shows every patch"
    )


def short(feature: str = LINEAR) -> str | None:
    """The records that keep ``feature`` from running, for the effects table; None: it may."""
    problems = missing(feature)
    return "not applied: " + ", ".join(names for names, _ in problems) if problems else None


def status() -> dict[str, str]:
    """Each feature: ``"active"`` or its inactive reason (for the report)."""
    return {name: inactive_reason(name) or "active" for name in FEATURES}
