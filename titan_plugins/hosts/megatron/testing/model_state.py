"""Layout-independent names for the parameters of tiny GPT chunks, to compare or copy runs.

A parameter's *global name* is its ``GPTModel`` name with the local layer index replaced by the
global layer (``layer_number - 1``) and the local expert index by the global expert index, so the
same weight has the same name at world size 1, under PP/VPP and under EP. The last pipeline stage's
``output_layer.weight`` (its copy of the tied embedding) is named ``embedding.word_embeddings.weight``
when embeddings are shared, as it is at PP=1.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
_TIED_OUTPUT = "output_layer.weight"
_TIED_EMBEDDING = "embedding.word_embeddings.weight"


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / ``Float16Module`` wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _global_name(model: torch.nn.Module, name: str) -> str:
    layer_match = _LAYER.match(name)
    if layer_match is not None:
        layer = model.decoder.layers[int(layer_match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[layer_match.end() :]
        expert_match = _EXPERT.search(name)
        if expert_match is not None:
            local = int(expert_match.group(1))
            global_expert = layer.mlp.local_expert_indices[local]
            name = (
                name[: expert_match.start()]
                + f".experts.local_experts.{global_expert}."
                + name[expert_match.end() :]
            )
    if name == _TIED_OUTPUT and getattr(model, "share_embeddings_and_output_weights", False):
        name = _TIED_EMBEDDING
    return name


def named_global_parameters(chunks: list) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Yield ``(global_name, parameter)`` for every parameter of this rank's chunks."""
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            yield _global_name(model, name), param


def global_state_dict(chunks: list) -> dict[str, torch.Tensor]:
    """Clones of this rank's parameters under their global names (merge ranks' dicts for all)."""
    return {name: param.detach().clone() for name, param in named_global_parameters(chunks)}


def load_global_state_dict(chunks: list, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (global names, e.g. from a world-size-1 run) into this rank's parameters.

    Call it before creating the optimizer (bf16 optimizers copy the weights at construction).
    Raises ``KeyError`` naming the parameter when ``state`` lacks one of this rank's weights.
    """
    with torch.no_grad():
        for name, param in named_global_parameters(chunks):
            if name not in state:
                raise KeyError(
                    f"load_global_state_dict: no weight for {name!r}; build the source model with "
                    "the same make_config() (layers, experts, embeddings) as the target."
                )
            param.copy_(state[name])


def state_snapshot(chunks: list, grads: bool = True) -> dict[str, torch.Tensor]:
    """Clones of parameters (and, with ``grads``, their gradients as ``<name>.grad``).

    Gradients are DDP's ``main_grad`` when present (what the optimizer consumed), else ``.grad``;
    a parameter without any gradient has no ``.grad`` entry. Names are global, so snapshots of
    different layouts (merged over ranks) compare key by key, bit for bit where the math allows.
    """
    snapshot: dict[str, torch.Tensor] = {}
    for name, param in named_global_parameters(chunks):
        snapshot[name] = param.detach().clone()
        if grads:
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                snapshot[name + ".grad"] = grad.detach().clone()
    return snapshot


def outputs_and_grads(
    layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One forward and backward of a layer that returns ``(output, bias)`` (megatron's MLP / MoE
    layers): the output, the input gradient and every parameter gradient of the loss
    ``(output * weight).sum()``, for comparing two implementations of the same layer."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "dx": x.grad, **grads}
