"""``MoELayer.forward`` with the chunked, overlapped expert stage for the flex/DeepEP path.

Only the plain forward of a flex-dispatcher (``moe_flex_dispatcher_backend="deepep"``) layer is
changed, only with ``TITAN_MOE_EP_OVERLAP_CHUNKS`` > 1, and (``TITAN_MOE_EP_OVERLAP_AUTO``, on by
default) only where the pipeline measured faster than the serial path (``autochunk``). Everything else - other dispatchers,
CUDA-graph partial capture (``intermediate_tensors``), and megatron's combined-1F1B EP overlap
(``overlap_moe_expert_parallel_comm``, which calls ``dispatch`` / ``routed_experts_compute`` /
``combine`` itself and never this forward) - runs megatron's original code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from titan_moe_ep_overlap import autochunk, settings, stats
from titan_moe_ep_overlap.overlap import ChunkedExperts, Comm

_DEFAULT_MAP = ["route", "expert_compute", "postprocess"]


def pipeline_chunks(layer: Any, intermediate_tensors: Any) -> int | None:
    """The configured chunk count for this flex/DeepEP call, or None for megatron's forward
    (other dispatchers, CUDA-graph partial capture, a configuration megatron rejects)."""
    config = layer.config
    if intermediate_tensors is not None or list(layer.fwd_execution_map) != _DEFAULT_MAP:
        return None
    if config.moe_token_dispatcher_type != "flex" or config.moe_flex_dispatcher_backend != "deepep":
        return None
    stats.add("layer_calls")
    if layer.training and layer.attn_tp_group.size() > 1 and not config.sequence_parallel:
        return None  # megatron's forward raises its own error for this
    return int(settings.CHUNKS.read())


def chunked_experts(layer: Any, hidden: torch.Tensor, probs: torch.Tensor, chunks: int) -> Any:
    """Dispatch -> experts -> combine of ``hidden`` ([T, H] after preprocess) in ``chunks``."""
    from megatron.core.transformer.moe import fused_a2a

    manager = layer.token_dispatcher._comm_manager
    buffer = fused_a2a.get_buffer(manager.group, fused_a2a.get_hidden_bytes(hidden))
    comm = Comm(buffer, fused_a2a.EventHandle, fused_a2a.EventOverlap, manager.num_experts,
                stats.start_pipelined_call())  # fmt: skip

    def compute(x: torch.Tensor, idx: torch.Tensor, p: torch.Tensor, counts: list[int]) -> Any:
        # the state megatron's dispatch would have left, for one chunk
        manager.dispatched_indices, manager.dispatched_probs = idx, p
        manager.tokens_per_expert = torch.tensor(counts)
        output, _ = layer.routed_experts_compute(x, p)
        return output

    output = ChunkedExperts.apply(
        hidden, probs.float(), manager.token_indices, comm, compute, chunks
    )
    manager.handle = None
    return output


def make_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory for ``MoELayer.forward``."""

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> Any:
        chunks = pipeline_chunks(self, intermediate_tensors)
        if chunks is None:
            return original(self, hidden_states, intermediate_tensors, padding_mask)
        chooser = autochunk.for_layer(self, chunks) if chunks > 1 and settings.AUTO.read() else None
        if chooser is not None:
            chunks = chooser.begin()
        try:
            if chunks == 1:
                stats.add("serial_calls")
                return original(self, hidden_states, intermediate_tensors, padding_mask)
            return pipelined(self, hidden_states, padding_mask, chunks)
        finally:
            if chooser is not None:
                chooser.end()

    def pipelined(
        self: Any, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None, chunks: int
    ) -> Any:
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def body(hidden_states: torch.Tensor, padding_mask: torch.Tensor | None) -> Any:
            shared_output = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            hidden, probs = self.preprocess(hidden_states, probs, routing_map)
            output = chunked_experts(self, hidden, probs, chunks)
            return self.postprocess(output, shared_output), None

        if self.moe_layer_recompute:
            from megatron.core import tensor_parallel

            return tensor_parallel.checkpoint(body, False, hidden_states, padding_mask)
        return body(hidden_states, padding_mask)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    forward.__doc__ = original.__doc__
    return forward
