"""titan-moe-ep-overlap: DeepEP-style MoE dispatch/combine on torch.distributed, overlapped.

``titan_moe_ep_overlap.buffer.Buffer`` is a DeepEP v1 ``Buffer`` work-alike; ``plugin`` wires it
(or a compatible installed DeepEP) into megatron-core's flex token dispatcher and pipelines the MoE
layer's all-to-alls with expert compute. :func:`effects` tells what it did in this process.
"""

from __future__ import annotations

from typing import Any

from titan_moe_ep_overlap.version import __version__ as __version__


def effects() -> dict[str, Any]:
    """This rank's counters: DeepEP-API dispatches/combines served by our backend, MoE layer
    calls pipelined or left serial, chunks, dispatches and combines the pipeline issued (totals,
    the last pipelined call and per-call averages). See ``stats.FIELDS`` for each name."""
    from titan_moe_ep_overlap import stats

    return stats.snapshot()
