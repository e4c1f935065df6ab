"""A deliberately broken plugin (test fixture, never installed): its patch applies to a target
every training step calls, but the work it exists for never happens (the condition it waits for
is never true), so it changes nothing and counts nothing. ``titan-plugins verify`` must name it
as applied-and-did-nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.patching import Patch, Signature

DONE = {"offloaded": 0}


def _never_acts(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_titan_verify_idle_never_set", False):  # upstream renamed the flag
            DONE["offloaded"] += 1
        return original(self, *args, **kwargs)

    return forward


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """One patch that applies and never acts."""
    register(
        Patch(
            id="verify_idle.linear",
            target="megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward",
            replace=_never_acts,
            requires=(SUPPORTED_MEGATRON,),
            signature=Signature(positional=("self",)),
            rationale="test fixture: applies and does nothing",
            upstream="megatron/core/tensor_parallel/layers.py ColumnParallelLinear.forward",
            remove_when="never: test fixture",
        )
    )


@hookimpl
def titan_effects() -> dict[str, Any]:
    """What it did: nothing."""
    return dict(DONE)
