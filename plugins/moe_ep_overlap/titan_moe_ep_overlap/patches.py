"""The plugin's patch records: where megatron-core 0.16 looks the names up, and why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_moe_ep_overlap import selection
from titan_plugins.patching import MISSING, MODULE, SUPPORTED_MEGATRON, Patch, Signature

FUSED_A2A = "megatron.core.transformer.moe.fused_a2a"
TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
# What moe_forward's chunked body calls on the layer, and how (checked on the imported code).
MOE_FORWARD = Signature(
    positional=("self", "hidden_states", "intermediate_tensors", "padding_mask"),
    contains=(
        "self.shared_experts_compute(hidden_states)",
        "self.route(hidden_states, padding_mask)",
        "self.preprocess(hidden_states, probs, routing_map)",
        "self.routed_experts_compute(",
        "self.postprocess(output, shared_expert_output)",
    ),
)
# fused_a2a's autograd functions read the DeepEP names from module globals at call time.
FUSED_A2A_USERS = Signature(attrs=("FusedDispatch", "FusedCombine", "get_buffer"))
_REMOVE = "never while megatron-core gates its flex/DeepEP path on `import deep_ep`"


def _backend_value(name: str) -> Callable[[Any], Any]:
    """Factory: our object unless a compatible DeepEP was chosen (then megatron keeps its own)."""

    def factory(original: Any) -> Any:
        if selection.uses_torch_backend() or original is MISSING or original is None:
            return _ours(name)
        return original

    return factory


def _ours(name: str) -> Any:
    from titan_moe_ep_overlap import wiring

    if name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
        return getattr(wiring, name)
    api = selection.torch_backend_api()
    return getattr(api, name)


def _moe_forward(original: Any) -> Any:
    from titan_moe_ep_overlap.moe_forward import make_forward

    return make_forward(original)


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
    for name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
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
    out.append(Patch(
        id="moe_ep_overlap.moe_layer_forward", target=f"{MOE_LAYER}:MoELayer.forward",
        replace=_moe_forward, requires=SUPPORTED_MEGATRON, signature=MOE_FORWARD,
        rationale="pipeline dispatch / expert compute / combine over token chunks in the flex "
        "(DeepEP) path so the all-to-alls overlap expert compute within one micro-batch",
        upstream="megatron/core/transformer/moe/moe_layer.py:357-444 (serial route->dispatch->"
        "experts->combine)",
        remove_when="megatron-core pipelines the MoE layer's all-to-alls inside a micro-batch",
    ))  # fmt: skip
    return out
