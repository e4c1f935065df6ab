"""``MoELayer.forward`` with the chunked, overlapped expert stage for the flex/DeepEP path.

Only the plain forward of a flex-dispatcher (``moe_flex_dispatcher_backend="deepep"``) layer is
changed, only with ``TITAN_MOE_EP_OVERLAP_CHUNKS`` > 1, and (``TITAN_MOE_EP_OVERLAP_AUTO``, on by
default) only where the pipeline measured faster than the serial path (``autochunk``). Everything
else runs megatron's original code: other dispatchers, CUDA-graph partial capture
(``intermediate_tensors``), Megatron's own paths that overlap the plugin's (``upstream_paths``:
HybridEP / NCCL EP, the combined-1F1B EP overlap, the dispatch-backward / wgrad overlap, the
shared-expert overlap of the flex dispatcher), and, from 0.18, a forward while Megatron's
inference engine runs a layer that has an inference dispatcher.

Megatron's forward differs per line, and the pipelined forward follows each (:data:`RULES`):
0.16 recomputes a ``recompute_modules=["moe"]`` layer in every mode; 0.17 only in training; 0.18
first selects the inference or the training dispatcher (``InferenceMode``); 0.19 keeps 0.18's
forward, and the pipeline's expert step (megatron's own ``routed_experts_compute``) picks up its
zero-copy buffers and the permute that returns ``pad_offsets`` / ``tokens_per_expert``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titan_moe_ep_overlap import autochunk, settings, stats, upstream_paths
from titan_moe_ep_overlap.overlap import ChunkedExperts, Comm

_DEFAULT_MAP = ["route", "expert_compute", "postprocess"]
_INFERENCE_UTILS = "megatron.core.inference.utils"  # InferenceMode, 0.18+ (moe_layer imports it)


@dataclass(frozen=True)
class LineRules:
    """What megatron's own ``MoELayer.forward`` of one line does that the pipeline must do too.

    :param recompute_in_eval: a ``moe_layer_recompute`` layer is recomputed in eval mode too
        (0.16; from 0.17 only ``self.training`` recomputes).
    :param inference_dispatcher: the forward first selects the layer's inference dispatcher
        while ``InferenceMode`` is active, else its training dispatcher (0.18+).
    """

    recompute_in_eval: bool
    inference_dispatcher: bool


RULES = {
    "0.16": LineRules(recompute_in_eval=True, inference_dispatcher=False),
    "0.17": LineRules(recompute_in_eval=False, inference_dispatcher=False),
    "0.18": LineRules(recompute_in_eval=False, inference_dispatcher=True),
    "0.19": LineRules(recompute_in_eval=False, inference_dispatcher=True),
}


def _inference_active() -> bool:
    """Whether Megatron's inference engine is using the model (read, never imported)."""
    mode = getattr(sys.modules.get(_INFERENCE_UTILS), "InferenceMode", None)
    return bool(mode is not None and mode.is_active())


def to_upstream(layer: Any, rules: LineRules) -> bool:
    """Whether this call must run megatron's own forward: the job selected a Megatron path that
    overlaps the plugin's (noted for the report), or Megatron's inference dispatcher serves it."""
    deferral = upstream_paths.for_config(layer.config)
    if deferral is not None:
        upstream_paths.note(deferral)
        return True
    if rules.inference_dispatcher and hasattr(layer, "_inference_token_dispatcher"):
        if _inference_active():
            return True  # megatron swaps in its inference dispatcher, which we do not serve
        # what megatron's forward does first: the training dispatcher back in place (a
        # previous call under InferenceMode left the inference one there)
        layer.token_dispatcher = layer._training_token_dispatcher
        layer.shared_expert_overlap = layer.config.moe_shared_expert_overlap
    return False


def pipeline_chunks(layer: Any, intermediate_tensors: Any, rules: LineRules) -> int | None:
    """The configured chunk count for this flex/DeepEP call, or None for megatron's forward
    (other dispatchers, CUDA-graph partial capture, Megatron's own overlapping paths, a
    configuration megatron rejects)."""
    config = layer.config
    if intermediate_tensors is not None or list(layer.fwd_execution_map) != _DEFAULT_MAP:
        return None
    if config.moe_token_dispatcher_type != "flex":
        return None
    stats.add("layer_calls")
    if to_upstream(layer, rules):
        stats.add("upstream_calls")
        return None
    if config.moe_flex_dispatcher_backend != "deepep":
        return None  # a backend megatron itself rejects
    if layer.training and layer.attn_tp_group.size() > 1 and not config.sequence_parallel:
        return None  # megatron's forward raises its own error for this
    return int(settings.CHUNKS.read())


def chunked_experts(
    layer: Any, hidden: torch.Tensor, probs: torch.Tensor, chunks: int, record: dict[str, int]
) -> Any:
    """Dispatch -> experts -> combine of ``hidden`` ([T, H] after preprocess) in ``chunks``,
    counted into ``record`` (the layer call's, from ``stats.start_pipelined_call``)."""
    from megatron.core.transformer.moe import fused_a2a

    manager = layer.token_dispatcher._comm_manager
    buffer = fused_a2a.get_buffer(manager.group, fused_a2a.get_hidden_bytes(hidden))
    comm = Comm(buffer, fused_a2a.EventHandle, fused_a2a.EventOverlap, manager.num_experts,
                record)  # fmt: skip

    def compute(x: torch.Tensor, idx: torch.Tensor, p: torch.Tensor, counts: list[int]) -> Any:
        # the state megatron's dispatch would have left, for one chunk (a CPU tensor of counts,
        # as megatron's FusedDispatch returns; 0.19's permute reads and returns it)
        manager.dispatched_indices, manager.dispatched_probs = idx, p
        manager.tokens_per_expert = torch.tensor(counts)
        output, _ = layer.routed_experts_compute(x, p)
        return output

    output = ChunkedExperts.apply(
        hidden, probs.float(), manager.token_indices, comm, compute, chunks
    )
    # what megatron's combine releases (0.19 also drops the received ids and probabilities):
    # the last chunk's would otherwise stay referenced until the layer's next call
    manager.handle = manager.dispatched_indices = manager.dispatched_probs = None
    return output


def make_forward(original: Callable[..., Any], line: str) -> Callable[..., Any]:
    """Patch factory for ``MoELayer.forward`` of megatron-core ``line`` (a key of RULES)."""
    rules = RULES[line]

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> Any:
        chunks = pipeline_chunks(self, intermediate_tensors, rules)
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
        # one layer call: its forward, a recompute of it and its backward count into one record
        record = stats.start_pipelined_call()

        def body(hidden_states: torch.Tensor, padding_mask: torch.Tensor | None) -> Any:
            shared_output = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            hidden, probs = self.preprocess(hidden_states, probs, routing_map)
            output = chunked_experts(self, hidden, probs, chunks, record)
            return self.postprocess(output, shared_output), None

        if self.moe_layer_recompute and (self.training or rules.recompute_in_eval):
            from megatron.core import tensor_parallel

            return tensor_parallel.checkpoint(body, False, hidden_states, padding_mask)
        return body(hidden_states, padding_mask)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    forward.__doc__ = original.__doc__
    return forward
