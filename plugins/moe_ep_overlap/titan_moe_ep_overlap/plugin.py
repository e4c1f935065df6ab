"""Hook implementations of the ``moe_ep_overlap`` plugin (the ``titan_plugins`` entry point).

Nothing here imports megatron or deep_ep at import time: backend choice and patches are lazy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.patching import Patch
from titan_plugins.settings import Setting


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Bind our DeepEP-API backend into megatron's fused_a2a / token_dispatcher, and the
    chunked overlapped MoE forward."""
    import sys

    from titan_moe_ep_overlap.patches import records

    selection = sys.modules.get("titan_moe_ep_overlap.selection")  # not imported for this
    if selection is not None:
        selection.reset()  # a new activation re-probes (env and installed packages may differ)
    for patch in records():
        register(patch)


@hookimpl
def titan_settings() -> list[Setting]:
    """``TITAN_MOE_EP_OVERLAP_BACKEND``, ``_CHUNKS`` and ``_AUTO`` (``settings.SETTINGS``)."""
    from titan_moe_ep_overlap.settings import SETTINGS

    return list(SETTINGS)


@hookimpl
def titan_moe_dispatcher(config: Any) -> Any:
    """The DeepEP-v1-API backend in use: an installed compatible ``deep_ep`` or ours."""
    from titan_moe_ep_overlap.selection import select_backend

    return select_backend().api


@hookimpl
def titan_configure(config: Any) -> None:
    """Warn early (error under STRICT) when the experts cannot be split over the EP ranks."""
    from titan_plugins.settings import complain

    experts = getattr(config, "num_moe_experts", None)
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    if experts and experts % ep != 0:
        complain(
            f"moe_ep_overlap: num_moe_experts={experts} is not divisible by "
            f"expert_model_parallel_size={ep}; choose --num-experts as a multiple of "
            f"--expert-model-parallel-size"
        )


@hookimpl
def titan_report() -> dict[str, Any]:
    """Backend in use and why, the chunk count, the DeepEP flag megatron sees, where the plugin
    stands aside or composes with Megatron's own path (``step_aside``, ``upstream_paths``), and
    what the backend and the pipeline did in this process (``effects``)."""
    import sys

    from titan_moe_ep_overlap import effects, selection, settings
    from titan_moe_ep_overlap.patches import FUSED_A2A

    fused_a2a = sys.modules.get(FUSED_A2A)
    megatron_flag = getattr(fused_a2a, "HAVE_DEEP_EP", None) if fused_a2a else None
    try:
        chosen = selection.select_backend()
    except Exception as err:  # STRICT turns an unusable deep_ep into an error; report it
        return {"backend": "error", "why": str(err), "effects": effects()}
    aside, composes = _standing()
    return {
        "active": not aside,
        **({"inactive_reason": "; ".join(why for _, why in aside)} if aside else {}),
        **({"composes_with": "; ".join(why for _, why in composes)} if composes else {}),
        "backend": chosen.backend,
        "why": chosen.detail,
        "chunks": settings.CHUNKS.read(),
        "auto": settings.AUTO.read(),
        "megatron_HAVE_DEEP_EP": megatron_flag,  # None: megatron's fused_a2a not imported
        "effects": effects(),
    }


def _standing() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(stepped aside, composes with)``, each a list of ``(short, sentence)``: the layout
    Megatron refuses the flex path in, and the Megatron paths this process's layers took."""
    from titan_moe_ep_overlap import step_aside, upstream_paths

    layout = step_aside.reason()
    aside = [(step_aside.SHORT, layout)] if layout else []
    composes = []
    for deferral in upstream_paths.seen():
        (composes if deferral.composes else aside).append((deferral.option, deferral.sentence()))
    return aside, composes


@hookimpl
def titan_effects() -> dict[str, Any]:
    """This rank's counters (flat): DeepEP-API dispatches/combines served by our backend, MoE
    layer calls pipelined, serial or handed to megatron's own forward, chunks/dispatches/combines
    the pipeline issued, and the automatic choice's decisions (``stats.FIELDS``). Where nothing
    of the plugin runs - Megatron refuses the flex dispatcher in this layout (``step_aside``), or
    the job selected Megatron's own dispatcher (HybridEP / NCCL EP) - ``stepped_aside`` names
    why and only the counters that are not zero follow, so the table does not show a row of
    zeros as if the plugin had run; where the backend serves Megatron's own overlap and the
    chunk pipeline stands aside, ``composes_with`` names that option."""
    from titan_moe_ep_overlap import stats

    counts: dict[str, Any] = stats.counts()
    aside, composes = _standing()
    if aside:
        counts = {
            "stepped_aside": ", ".join(short for short, _ in aside),
            **{k: v for k, v in counts.items() if v},
        }
    if composes:
        counts = {"composes_with": ", ".join(short for short, _ in composes), **counts}
    return counts


@hookimpl
def titan_doctor() -> list[Any]:
    """DeepEP presence / API compatibility (v2 detected), the transport, and the chunk knob."""
    from titan_moe_ep_overlap.doctor import checks

    return checks()
