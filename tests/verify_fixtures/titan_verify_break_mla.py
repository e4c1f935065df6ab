"""A deliberately broken plugin (test fixture, never installed) that breaks multi-latent attention
only: it scales MLA's output by 1.01. A model without MLA never calls it (the MoE GPT's layouts
would call it a plugin that did nothing); ``titan-plugins verify``'s Kimi-shaped layout must name
it for the numbers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.patching import Patch, Signature

CALLS = {"mla": 0}


def _scale_mla(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        output, bias = original(self, *args, **kwargs)
        CALLS["mla"] += 1
        return output * 1.01, bias

    return forward


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """One patch that applies cleanly and changes MLA's numbers."""
    register(
        Patch(
            id="verify_break_mla.forward",
            target="megatron.core.transformer.multi_latent_attention:MultiLatentAttention.forward",
            replace=_scale_mla,
            requires=(SUPPORTED_MEGATRON,),
            signature=Signature(positional=("self", "hidden_states", "attention_mask")),
            rationale="test fixture: perturbs multi-latent attention only",
            upstream="megatron/core/transformer/multi_latent_attention.py forward",
            remove_when="never: test fixture",
        )
    )


@hookimpl
def titan_effects() -> dict[str, Any]:
    """The calls it perturbed."""
    return dict(CALLS)
