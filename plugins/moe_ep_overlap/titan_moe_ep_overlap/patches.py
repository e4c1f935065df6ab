"""The plugin's patch records: where megatron-core 0.16-0.19 looks the names up, and why.

Importing this module (and applying its records while ``import megatron.core`` runs) loads none
of the backend or the pipeline: the replacements are the stand-ins and entry points of
``bindings``, which import the rest on first use; the backend choice (``selection``) is imported
only when a ``deep_ep`` is installed (then its API must be checked).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from titan_moe_ep_overlap import bindings
from titan_moe_ep_overlap.deep_ep_lookup import deep_ep_installed
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON, megatron_lines
from titan_plugins.patching import MISSING, MODULE, Patch, Signature

FUSED_A2A = "megatron.core.transformer.moe.fused_a2a"
TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
# What moe_forward's chunked body calls on the layer, and how (checked on the imported code).
_CALLS = (
    "self.shared_experts_compute(hidden_states)",
    "self.route(hidden_states, padding_mask)",
    "self.preprocess(hidden_states, probs, routing_map)",
    "self.routed_experts_compute(",
    "self.postprocess(output, shared_expert_output)",
)
_FORWARD_PARAMS = ("self", "hidden_states", "intermediate_tensors", "padding_mask")
_RECOMPUTE_ALWAYS = "if self.moe_layer_recompute:"  # 0.16: in every mode
_RECOMPUTE_TRAINING = "self.moe_layer_recompute and self.training"  # 0.17+: in training only
_INFERENCE_SWITCH = ("InferenceMode.is_active()", "self._training_token_dispatcher")  # 0.18+
_ZERO_COPY = "self.token_dispatcher.get_expert_zero_copy_buffers()"  # 0.19
_WGRAD_OVERLAP = "self.config.overlap_dispatch_backward_with_experts_wgrad"  # 0.18+
# What each line's forward does, as far as the pipelined forward must do it too
# (moe_forward.RULES); a fork that changed one of them is skipped, not silently served.
MOE_FORWARD = {
    "0.16": (Signature(positional=_FORWARD_PARAMS, contains=(*_CALLS, _RECOMPUTE_ALWAYS),
                       lacks=(_RECOMPUTE_TRAINING, _INFERENCE_SWITCH[0])),),
    "0.17": (Signature(positional=_FORWARD_PARAMS, contains=(*_CALLS, _RECOMPUTE_TRAINING),
                       lacks=(_INFERENCE_SWITCH[0],)),),
    "0.18": (Signature(positional=_FORWARD_PARAMS, attrs=("InferenceMode",),
                       contains=(*_CALLS, _RECOMPUTE_TRAINING, *_INFERENCE_SWITCH)),
             # the dispatch-backward/wgrad overlap the pipeline stands aside for
             Signature(of="MoELayer.routed_experts_compute", contains=(_WGRAD_OVERLAP,),
                       lacks=(_ZERO_COPY,))),
    "0.19": (Signature(positional=_FORWARD_PARAMS, attrs=("InferenceMode",),
                       contains=(*_CALLS, _RECOMPUTE_TRAINING, *_INFERENCE_SWITCH)),
             # the per-chunk expert step runs megatron's own routed_experts_compute: its
             # zero-copy buffers (None for DeepEP) and the flex dispatcher's per-expert counts,
             # which the permute of 0.19's _DeepepManager reads and returns (with pad_offsets)
             Signature(of="MoELayer.routed_experts_compute",
                       contains=(_WGRAD_OVERLAP, _ZERO_COPY)),
             Signature(of="MoEFlexTokenDispatcher.dispatch_postprocess",
                       contains=("self._comm_manager.get_number_of_tokens_per_expert()",))),
}  # fmt: skip
_FORWARD_UPSTREAM = {
    "0.16": "moe_layer.py:357-444 (serial route->dispatch->experts->combine; recompute in "
    "every mode)",
    "0.17": "moe_layer.py:524-617 (0.17.1: recomputes only when self.training, :599)",
    "0.18": "moe_layer.py:598-703 (0.18.2: selects the inference or training dispatcher first, "
    ":628-637, recompute in training :685; overlap_dispatch_backward_with_experts_wgrad in preprocess / "
    "routed_experts_compute)",
    "0.19": "moe_layer.py:607-712 (0.19.2: as 0.18, :637-646; routed_experts_compute passes zero-copy "
    "buffers, :549-559; _DeepepManager's permute returns pad_offsets / tokens_per_expert)",
}
# fused_a2a's autograd functions read the DeepEP names from module globals at call time.
FUSED_A2A_USERS = Signature(attrs=("FusedDispatch", "FusedCombine", "get_buffer"))
_REMOVE = "never while megatron-core gates its flex/DeepEP path on `import deep_ep`"


def _backend_value(name: str) -> Callable[[Any], Any]:
    """Factory: ours unless a compatible DeepEP was chosen (then megatron keeps its own)."""

    def factory(original: Any) -> Any:
        return original if _deep_ep_chosen(original) else _ours(name)

    return factory


def _deep_ep_chosen(original: Any) -> bool:
    """Whether megatron keeps the ``deep_ep`` object it imported for this name.

    Without ``deep_ep`` installed (the common case) nothing is imported to decide. With it, the
    backend choice checks its API: an unusable build is reported (an error under STRICT) and ours
    is bound.
    """
    if not deep_ep_installed():
        return False
    from titan_moe_ep_overlap import selection

    if selection.uses_torch_backend():
        return False
    ours = (*bindings.ENTRY_POINTS.values(), *bindings.STAND_INS.values())
    return original is not MISSING and original is not None and all(original is not o for o in ours)


def _ours(name: str) -> Any:
    return bindings.ENTRY_POINTS.get(name) or bindings.STAND_INS[name]


def backend_bound(module: Any) -> bool:
    """Whether ``module`` (megatron's fused_a2a) is served by this plugin's backend."""
    return getattr(module, "Buffer", None) is bindings.Buffer and all(
        getattr(module, name, None) is entry for name, entry in bindings.ENTRY_POINTS.items()
    )


def _have_deep_ep(original: Any) -> Any:
    """Factory for ``HAVE_DEEP_EP``: True when a real DeepEP v1 was imported (megatron's own
    value) or when our backend is bound in fused_a2a (the records above, applied first)."""
    if original is True:
        return original
    module = sys.modules.get(FUSED_A2A)
    return True if module is not None and backend_bound(module) else original


def records() -> list[Patch]:
    """Every patch of the plugin (lazy: applied when the target module executes)."""
    out = []
    for name in ("Buffer", "EventHandle", "EventOverlap"):
        out.append(Patch(
            id=f"moe_ep_overlap.fused_a2a_{name}", target=f"{FUSED_A2A}:{name}",
            replace=_backend_value(name), requires=SUPPORTED_MEGATRON, create=True, rebind_aliases=False,
            signature=FUSED_A2A_USERS,
            rationale=f"megatron's FusedDispatch/FusedCombine read `{name}` from fused_a2a's "
            "globals at call time; without DeepEP v1 it is unbound, so ours is bound there",
            upstream="megatron/core/transformer/moe/fused_a2a.py:8-14", remove_when=_REMOVE,
        ))  # fmt: skip
    for name in bindings.ENTRY_POINTS:
        for module, where in ((FUSED_A2A, "fused_a2a.py:211-262"),
                              (TOKEN_DISPATCHER, "token_dispatcher.py:20-26")):  # fmt: skip
            short = module.rsplit(".", 1)[1]
            out.append(Patch(
                id=f"moe_ep_overlap.{short}_{name}", target=f"{module}:{name}",
                replace=_backend_value(name), requires=SUPPORTED_MEGATRON, rebind_aliases=False,
                signature=FUSED_A2A_USERS if module == FUSED_A2A else Signature(
                    attrs=("_DeepepManager",), of=MODULE, contains=(f"{name}(",)),
                rationale=f"`{name}` is None without DeepEP and token_dispatcher from-imports it;"
                " bind the torch.distributed entry point where it is looked up",
                upstream=f"megatron/core/transformer/moe/{where}", remove_when=_REMOVE,
            ))  # fmt: skip
    # After the records above (the engine applies a module's targets in registration order), so
    # the flag reads whether they really bound the backend.
    out.append(Patch(
        id="moe_ep_overlap.fused_a2a_HAVE_DEEP_EP", target=f"{FUSED_A2A}:HAVE_DEEP_EP",
        replace=_have_deep_ep, requires=SUPPORTED_MEGATRON, rebind_aliases=False,
        signature=Signature(of=MODULE, contains=("HAVE_DEEP_EP = False",),
                            attrs=("HAVE_DEEP_EP", "FusedDispatch", "get_buffer")),
        rationale="megatron's capability flag for the flex/'deepep' path is False when "
        "`import deep_ep` fails, though our backend serves that path; Megatron's own checks, "
        "tests (tests/unit_tests/transformer/moe/test_token_dispatcher.py, "
        "a2a_overlap/test_cuda_graphed_schedule_chunk_1f1b.py) and scripts gating on it must see "
        "the backend. True only while the backend is bound; HAVE_HYBRIDEP stays megatron's",
        upstream="megatron/core/transformer/moe/fused_a2a.py:8-14 (the only definition in "
        "megatron-core 0.16.1; fused_dispatch / fused_combine / set_deepep_num_sms are the names "
        "derived from it, bound above)",
        remove_when=_REMOVE,
    ))  # fmt: skip
    out += _forward_records()
    return out


def _forward_records() -> list[Patch]:
    """The pipelined ``MoELayer.forward``, one record per Megatron line (each line's forward
    differs in what the pipeline must keep: ``moe_forward.RULES``), and ``MoELayer.__init__``,
    where each flex layer's config says whether the job selected Megatron's own overlap."""
    out = []
    for line, signature in MOE_FORWARD.items():
        out.append(Patch(
            id="moe_ep_overlap.moe_layer_forward" + ("" if line == "0.16" else
                                                      f".line_{line.replace('.', '_')}"),
            target=f"{MOE_LAYER}:MoELayer.forward", replace=bindings.moe_forward(line),
            requires=megatron_lines(line, line), signature=signature,
            rationale="pipeline dispatch / expert compute / combine over token chunks in the "
            "flex (DeepEP) path so the all-to-alls overlap expert compute within one "
            f"micro-batch, keeping what megatron-core {line}'s forward does (recompute rule, "
            "dispatcher choice); Megatron's own overlapping paths run its forward",
            upstream=f"megatron/core/transformer/moe/{_FORWARD_UPSTREAM[line]}",
            remove_when="megatron-core pipelines the MoE layer's all-to-alls inside a micro-batch",
        ))  # fmt: skip
    out.append(Patch(
        id="moe_ep_overlap.moe_layer_init", target=f"{MOE_LAYER}:MoELayer.__init__",
        replace=bindings.moe_layer_init, requires=SUPPORTED_MEGATRON,
        signature=Signature(positional=("self", "config")),
        rationale="each flex MoE layer's config, as it is built, tells the report and the "
        "effects table whether the job selected Megatron's own path that overlaps the "
        "plugin's (HybridEP / NCCL EP, combined-1F1B EP overlap, dispatch-backward/wgrad or "
        "shared-expert overlap): the combined-1F1B schedule never calls MoELayer.forward",
        upstream="megatron/core/transformer/moe/moe_layer.py MoELayer.__init__ (config-driven "
        "choice of dispatcher and overlap)",
        remove_when="megatron-core reports which MoE overlap path a layer takes",
    ))  # fmt: skip
    return out
