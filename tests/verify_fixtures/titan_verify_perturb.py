"""A deliberately broken plugin (test fixture, never installed): it scales every column-parallel
linear output by 1.01 and the router's logits by 1.05. Megatron's routers, MLP and MoE-layer
unit tests pass with it (they check shapes and self-consistency); ``titan-plugins verify``'s
differential training check must name it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.patching import Patch, Signature

CALLS = {"linear": 0, "router": 0}


def _scale_linear(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        output, bias = original(self, *args, **kwargs)
        CALLS["linear"] += 1
        return output * 1.01, bias

    return forward


def _scale_router(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def gating(self: Any, input: Any) -> Any:
        CALLS["router"] += 1
        return original(self, input) * 1.05

    return gating


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Two patches that apply cleanly and change the numbers."""
    register(
        Patch(
            id="verify_perturb.linear",
            target="megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward",
            replace=_scale_linear,
            requires=(SUPPORTED_MEGATRON,),
            signature=Signature(positional=("self",)),
            rationale="test fixture: perturbs numerics",
            upstream="megatron/core/tensor_parallel/layers.py ColumnParallelLinear.forward",
            remove_when="never: test fixture",
        )
    )
    register(
        Patch(
            id="verify_perturb.router",
            target="megatron.core.transformer.moe.router:TopKRouter.gating",
            replace=_scale_router,
            requires=(SUPPORTED_MEGATRON,),
            signature=Signature(positional=("self", "input")),
            rationale="test fixture: perturbs the router's gating",
            upstream="megatron/core/transformer/moe/router.py Router.gating",
            remove_when="never: test fixture",
        )
    )


@hookimpl
def titan_effects() -> dict[str, Any]:
    """The calls it perturbed."""
    return dict(CALLS)
