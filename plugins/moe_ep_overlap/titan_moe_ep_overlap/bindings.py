"""Everything the plugin binds into megatron's modules: light stand-ins and entry points.

``import megatron.core`` executes ``fused_a2a`` and ``moe_layer``, so every replacement the plugin
binds there is created while Megatron loads. What is bound is small and imports nothing of the
plugin: the backend (``buffer`` -> ``dispatch_ops``, ``comm``, ``layout``, ``rowpack``;
``events``) and the pipeline (``moe_forward`` -> ``overlap``, ``autochunk``) load when a
flex/DeepEP layer really runs (issue 17: activation costs nothing for other dispatchers).

megatron-core defines ``fused_dispatch`` / ``fused_combine`` / ``set_deepep_num_sms`` only when
``from deep_ep import Buffer`` succeeds, and its autograd functions ``FusedDispatch`` /
``FusedCombine`` look ``Buffer``, ``EventHandle`` and ``EventOverlap`` up in fused_a2a's module
globals at call time. Those globals get our classes (behind the stand-ins below) and the three
entry points run megatron's own autograd functions, so megatron's code (forward, backward, cached
dispatch in the combine's backward) runs unchanged on torch.distributed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_FLEX = "flex"


class _Deferred(type):
    """Metaclass of a class stand-in: calls, attribute reads/writes and ``isinstance`` go to the
    real class, imported from ``_target = "module:Name"`` the first time it is needed."""

    def _real(cls) -> type:
        real = cls.__dict__.get("_loaded")
        if real is None:
            module, name = cls.__dict__["_target"].split(":")
            real = getattr(importlib.import_module(module), name)
            type.__setattr__(cls, "_loaded", real)
        return real

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(cls._real(), name)

    def __setattr__(cls, name: str, value: Any) -> None:
        setattr(cls._real(), name, value)  # e.g. ``Buffer.num_sms = 24`` reaches the real class

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._real())

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._real())


class Buffer(metaclass=_Deferred):
    """``fused_a2a.Buffer`` until first use: then :class:`titan_moe_ep_overlap.buffer.Buffer`."""

    _target = "titan_moe_ep_overlap.buffer:Buffer"


class EventHandle(metaclass=_Deferred):
    """``fused_a2a.EventHandle``: :class:`titan_moe_ep_overlap.events.EventHandle`."""

    _target = "titan_moe_ep_overlap.events:EventHandle"


class EventOverlap(metaclass=_Deferred):
    """``fused_a2a.EventOverlap``: :class:`titan_moe_ep_overlap.events.EventOverlap`."""

    _target = "titan_moe_ep_overlap.events:EventOverlap"


STAND_INS = {"Buffer": Buffer, "EventHandle": EventHandle, "EventOverlap": EventOverlap}


def real(stand_in: Any) -> Any:
    """The class a stand-in resolves to (the object itself if it is not a stand-in)."""
    return stand_in._real() if isinstance(stand_in, _Deferred) else stand_in


def _fused_a2a() -> Any:
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a


def fused_dispatch(
    x: Any,
    token_indices: Any,
    token_probs: Any,
    num_experts: int,
    group: Any,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> Any:
    """megatron's ``fused_dispatch`` (DeepEP path) through ``FusedDispatch`` on our Buffer."""
    return _fused_a2a().FusedDispatch.apply(
        x.contiguous(), token_indices, token_probs, num_experts, group, async_finish,
        allocate_on_comm_stream,
    )  # fmt: skip


def fused_combine(
    x: Any, group: Any, handle: Any, async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> Any:  # fmt: skip
    """megatron's ``fused_combine`` (DeepEP path) through ``FusedCombine`` on our Buffer."""
    return _fused_a2a().FusedCombine.apply(x, group, handle, async_finish, allocate_on_comm_stream)


def set_deepep_num_sms(num_sms: int) -> None:
    """megatron's ``set_deepep_num_sms``: forwarded to the Buffer class in use."""
    _fused_a2a().Buffer.set_num_sms(num_sms)


ENTRY_POINTS = {
    "fused_dispatch": fused_dispatch,
    "fused_combine": fused_combine,
    "set_deepep_num_sms": set_deepep_num_sms,
}


def moe_forward(line: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Patch factory of ``MoELayer.forward`` for megatron-core ``line``: megatron's forward for
    every dispatcher but flex, and for flex the pipelined forward that follows that line's
    forward (``moe_forward.RULES``; imported on the first flex call)."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        pipelined: list[Callable[..., Any]] = []

        def forward(
            self: Any,
            hidden_states: Any,
            intermediate_tensors: Any = None,
            padding_mask: Any = None,
        ) -> Any:
            if self.config.moe_token_dispatcher_type != _FLEX:
                return original(self, hidden_states, intermediate_tensors, padding_mask)
            if not pipelined:
                from titan_moe_ep_overlap.moe_forward import make_forward

                pipelined.append(make_forward(original, line))
            return pipelined[0](self, hidden_states, intermediate_tensors, padding_mask)

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        forward.__doc__ = original.__doc__
        return forward

    return factory


def moe_layer_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory of ``MoELayer.__init__``: megatron's constructor, then the layer's config
    tells the plugin whether the job selected one of Megatron's own paths that overlap the
    plugin's (``upstream_paths``), so the report says so even where that path never calls
    ``MoELayer.forward`` (the combined-1F1B EP overlap)."""

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, config, *args, **kwargs)
        if getattr(config, "moe_token_dispatcher_type", None) == _FLEX:
            from titan_moe_ep_overlap import upstream_paths

            upstream_paths.note_config(config)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    return __init__
