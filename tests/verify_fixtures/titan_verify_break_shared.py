"""A deliberately broken plugin (test fixture, never installed) that breaks the shared expert
only: it scales SharedExpertMLP's output by 1.01. A MoE layer without a shared expert never calls
it; ``titan-plugins verify``'s Kimi-shaped layout must name it for the numbers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.patching import Patch, Signature

CALLS = {"shared_expert": 0}


def _scale_shared(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, hidden_states: Any) -> Any:
        CALLS["shared_expert"] += 1
        return original(self, hidden_states) * 1.01

    return forward


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """One patch that applies cleanly and changes the shared expert's numbers."""
    register(
        Patch(
            id="verify_break_shared.forward",
            target="megatron.core.transformer.moe.shared_experts:SharedExpertMLP.forward",
            replace=_scale_shared,
            requires=(SUPPORTED_MEGATRON,),
            signature=Signature(positional=("self", "hidden_states")),
            rationale="test fixture: perturbs the shared expert only",
            upstream="megatron/core/transformer/moe/shared_experts.py SharedExpertMLP.forward",
            remove_when="never: test fixture",
        )
    )


@hookimpl
def titan_effects() -> dict[str, Any]:
    """The calls it perturbed."""
    return dict(CALLS)
