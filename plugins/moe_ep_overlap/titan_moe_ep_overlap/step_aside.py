"""Where the plugin steps aside: layouts in which Megatron itself refuses the path it serves.

The plugin serves megatron's flex dispatcher with the DeepEP backend. Megatron's
``MoEFlexTokenDispatcher`` refuses TP x EP = 1 (``assert self.tp_size * self.ep_size > 1``):
there is nothing to dispatch across, and the plugin must not pretend otherwise (Megatron's own
refusal stands for a job that asks for flex there). This module only reads megatron's parallel
state, once it exists, so the report and the effects table say that the plugin stands aside and
why, instead of showing zero dispatches as if it had run.
"""

from __future__ import annotations

import sys

SHORT = "TP x EP = 1"


def reason() -> str | None:
    """Why the plugin cannot act in this process's layout, or None (it can, or no layout yet)."""
    ps = sys.modules.get("megatron.core.parallel_state")  # never imported for this
    if ps is None:
        return None
    try:
        if not ps.model_parallel_is_initialized():
            return None
        tp = ps.get_tensor_model_parallel_world_size()
        ep = ps.get_expert_model_parallel_world_size()
    except Exception:  # a half-initialised parallel state: no layout to judge
        return None
    if tp * ep > 1:
        return None
    return (
        f"stepped aside: {SHORT} in this layout, and Megatron's flex dispatcher (the path this "
        "plugin serves) requires TP x EP > 1; the MoE layers run Megatron's own dispatcher "
        "(alltoall / allgather). Use --expert-model-parallel-size 2 or more to use the plugin"
    )
