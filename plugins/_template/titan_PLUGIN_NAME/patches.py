"""PLUGIN_NAME's patch records: what it changes in Megatron, where, why, and until when.

Never import megatron at module level: the engine calls a replacement factory right after its
target module has executed (or at once if it already has), so megatron is loaded by then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.patching import Patch, Signature

CALLS = {"initialize_model_parallel": 0}


def _count_calls(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement factory: receives the current function, returns the replacement."""

    @functools.wraps(original)  # also sets __wrapped__, so tests and tools see the original
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        CALLS["initialize_model_parallel"] += 1
        return original(*args, **kwargs)

    return initialize_model_parallel


def patches() -> list[Patch]:
    """New records for one activation (the engine keeps each record's status)."""
    return [
        Patch(
            id="PLUGIN_NAME.count_initialize_model_parallel",
            target="megatron.core.parallel_state:initialize_model_parallel",
            replace=_count_calls,
            # the project's Megatron range (setup.cfg's `megatron` extra says the same)
            requires=SUPPORTED_MEGATRON,
            # what the replacement relies on in the imported code, checked before it is applied:
            # this one only forwards, so just that the target exists; list the params / attrs /
            # source fragments yours uses (docs/core-api.md, Patch records)
            signature=Signature(),
            rationale="example: count model-parallel initialisations (replace with yours)",
            upstream="megatron/core/parallel_state.py initialize_model_parallel",
            remove_when="when upstream makes the patch unnecessary (say which release)",
        )
    ]
