"""Where the job selects Megatron's own path that overlaps this plugin's: compose or step aside.

Megatron grew its own answers to what the plugin does. Where a job switches one on, the chunk
pipeline must not run beside it (never two overlap schemes, never a second dispatch of the same
tokens), and the report and the effects table say what happened instead:

=============================================== ============================================
the job's config (flex dispatcher)              the plugin
=============================================== ============================================
``moe_flex_dispatcher_backend="hybridep"``      steps aside: Megatron's HybridEP dispatcher
``moe_flex_dispatcher_backend="ncclep"`` (0.19)  steps aside: NCCL EP through Transformer Engine
``overlap_moe_expert_parallel_comm``            composes: its combined-1F1B schedule dispatches
                                                on this plugin's backend; the pipeline stands aside
``overlap_dispatch_backward_with_experts_wgrad`` composes: Megatron defers the expert weight
(0.18+)                                         gradients into the dispatch backward of the
                                                unchunked layer; the pipeline stands aside
``moe_shared_expert_overlap`` (0.18+ on flex)   composes: Megatron's flex dispatcher runs the
                                                shared expert beside its dispatch; the pipeline
                                                stands aside
=============================================== ============================================

Nothing here imports torch or megatron: the answers come from a layer's config, seen when a MoE
layer is built (the ``MoELayer.__init__`` record) and at each forward call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Deferral:
    """One of Megatron's own paths the job selected, and what the plugin does about it.

    :param option: the config field (and value) that selects it, as the effects table shows it.
    :param composes: True where the plugin's backend still serves Megatron's dispatches and only
        the chunk pipeline stands aside; False where nothing of the plugin runs.
    :param megatron: what Megatron does instead, for the report.
    """

    option: str
    composes: bool
    megatron: str

    def sentence(self) -> str:
        """The report's line: which path, and what the plugin does."""
        if self.composes:
            return (
                f"composes with {self.option}: {self.megatron}; the flex dispatches run on this "
                "plugin's backend and its chunk pipeline stands aside (no second overlap)"
            )
        return (
            f"stepped aside: {self.option} selects {self.megatron}; nothing of this plugin runs "
            "in those layers. Use --moe-flex-dispatcher-backend deepep to use the plugin"
        )


_OWN_BACKENDS = {
    "hybridep": "Megatron's HybridEP dispatcher",
    "ncclep": "Megatron's NCCL EP dispatcher (Transformer Engine)",
}
_OVERLAPS = (
    ("overlap_moe_expert_parallel_comm", "Megatron's combined-1F1B EP overlap schedules "
     "dispatch and combine itself"),
    ("overlap_dispatch_backward_with_experts_wgrad", "Megatron overlaps the dispatch backward "
     "with the experts' delayed weight gradients"),
    ("moe_shared_expert_overlap", "Megatron's flex dispatcher runs the shared expert beside its "
     "dispatch"),
)  # fmt: skip


def for_config(config: Any) -> Deferral | None:
    """The Megatron path ``config`` selects that overlaps the plugin's, or None (the plugin's
    flex/DeepEP path, or a dispatcher the plugin does not serve at all)."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return None
    backend = getattr(config, "moe_flex_dispatcher_backend", "deepep")
    if backend in _OWN_BACKENDS:
        return Deferral(f"moe_flex_dispatcher_backend={backend}", False, _OWN_BACKENDS[backend])
    for field, megatron in _OVERLAPS:
        if bool(getattr(config, field, False)):
            return Deferral(field, True, megatron)
    return None


_seen: dict[str, Deferral] = {}  # by option, in the order first seen


def note(deferral: Deferral) -> None:
    """Remember that a layer of this process took ``deferral`` (for the report and effects)."""
    _seen.setdefault(deferral.option, deferral)


def note_config(config: Any) -> None:
    """Remember what ``config`` (a MoE layer's, as it is built) selects, if anything."""
    deferral = for_config(config)
    if deferral is not None:
        note(deferral)


def seen() -> list[Deferral]:
    """Every deferral a MoE layer of this process took, oldest first."""
    return list(_seen.values())


def reset() -> None:
    """Forget them (tests)."""
    _seen.clear()
