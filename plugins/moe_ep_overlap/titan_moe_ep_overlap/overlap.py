"""Chunked MoE expert stage: dispatch, expert compute and combine pipelined over token chunks.

The tokens of a MoE layer are split into ``n`` contiguous chunks. Forward::

    dispatch(0)
    for i in 0..n-1:
        dispatch(i+1)            # in flight ...
        wait dispatch(i); experts(i)
        combine(i)               # ... in flight with experts(i+1)
    wait all combines

Backward mirrors it: the gradient of chunk i+1 is being dispatched (DeepEP cached dispatch) and the
input/probability gradients of chunk i-1 combined while autograd runs the expert backward of chunk i
(a nested graph built per chunk in forward). The DeepEP v1 API (``async_finish``, ``previous_event``
and events) is all it uses, so it runs on a real DeepEP ``Buffer`` as on ours.

Per token the math is megatron's flex path (the same expert MLPs on the same rows, the combine's sum
in rank = ascending expert order); only weight gradients are summed chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titan_moe_ep_overlap import stats

Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


@dataclass
class Comm:
    """The DeepEP-API objects one pipeline uses (a Buffer and its event classes)."""

    buffer: Any
    event_handle: type
    event_overlap: type
    num_experts: int
    record: dict[str, int] | None = None  # this layer call's counters (stats.start_pipelined_call)

    def _now(self) -> Any:
        return self.event_overlap(self.event_handle())

    def layouts(self, indices: list[torch.Tensor]) -> list[tuple]:
        """DeepEP layouts of every chunk; with our Buffer, plus all counts exchanged at once."""
        layouts = [
            self.buffer.get_dispatch_layout(
                idx,
                self.num_experts,
                previous_event=self._now(),
                async_finish=True,
                allocate_on_comm_stream=True,
            )  # fmt: skip
            for idx in indices
        ]
        if not hasattr(self.buffer, "exchange_layouts"):  # DeepEP: counts exchanged per dispatch
            return [(*layout, {}) for layout in layouts]
        tables = self.buffer.exchange_layouts([(lay[0], lay[2]) for lay in layouts])
        return [(*lay, {"layout_table": t}) for lay, t in zip(layouts, tables)]

    def dispatch(
        self, x: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor, layout: tuple
    ) -> tuple:
        """Start dispatching one chunk; returns DeepEP's 6-tuple (event last)."""
        per_rank, per_rdma, per_expert, in_rank, event, extra = layout
        stats.add("pipeline_dispatches", call=self.record)
        return self.buffer.dispatch(
            x, topk_idx=idx, topk_weights=probs, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, previous_event=event, async_finish=True,
            allocate_on_comm_stream=True, **extra,
        )  # fmt: skip

    def redispatch(self, grad: torch.Tensor, handle: Any) -> tuple:
        """Start a cached dispatch of a gradient chunk along an earlier dispatch's handle."""
        stats.add("pipeline_dispatches", call=self.record)
        return self.buffer.dispatch(
            grad, handle=handle, previous_event=self._now(), async_finish=True,
            allocate_on_comm_stream=True,
        )  # fmt: skip

    def combine(self, y: torch.Tensor, handle: Any, weights: torch.Tensor | None = None) -> tuple:
        """Start combining one chunk; returns ``(combined_x, combined_weights, event)``."""
        stats.add("pipeline_combines", call=self.record)
        return self.buffer.combine(
            y, handle, topk_weights=weights, previous_event=self._now(), async_finish=True,
            allocate_on_comm_stream=True,
        )  # fmt: skip


def chunk_bounds(num_tokens: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous, near-equal ranges covering ``num_tokens`` (some may be empty).

    The count never depends on ``num_tokens``: every EP rank must issue the same collectives.
    """
    base, extra = divmod(num_tokens, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _release_storage(y: torch.Tensor) -> None:
    """Free the expert output's memory but keep it as the root of its chunk's graph.

    Megatron's serial path does not keep the expert output alive until the backward (nothing saves
    it); holding it per chunk would add ``[received tokens, hidden]`` per MoE layer. The combine
    reads a detached alias that keeps the old storage until its transfer completed, and an op
    that saved ``y`` for its backward holds its own reference - so this only frees what nobody
    needs (the trick megatron's ``deallocate_output_tensor`` uses for pipeline outputs).
    """
    y.data = torch.empty((1,), dtype=y.dtype, device=y.device)


def _backward_from(y: torch.Tensor, grad: torch.Tensor) -> None:
    """``y.backward(grad)`` for a root whose storage was released (shape no longer matches).

    Calls the autograd engine directly, as megatron's ``schedules.custom_backward`` does, because
    ``torch.autograd.backward`` checks ``grad`` against the (now 1-element) shape of ``y``.
    """
    if y.grad_fn is None:  # nothing upstream needs a gradient (e.g. experts frozen, no tokens)
        return
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(
        tensors=(y,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True,
    )  # fmt: skip


class _GradTap(torch.autograd.Function):
    """Identity on the received tokens that hands their gradient to ``sink``.

    A leaf ``x.requires_grad_()`` would keep the received tokens alive until the backward (the
    leaf is referenced by its grad accumulator); megatron's serial path frees them once the
    experts' permute copied them. The tap passes a view on and keeps nothing but the sink.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, sink: list) -> torch.Tensor:
        """Return a view of ``x`` whose gradient will land in ``sink``."""
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """Store the gradient; nothing flows further (``x`` came from a transfer)."""
        ctx.sink.append(grad)
        return None, None, None


@dataclass
class _Chunk:
    handle: Any
    x_grad: list  # receives the gradient of the received tokens (see _GradTap)
    x_shape: torch.Size
    probs: torch.Tensor  # received probabilities (leaf: [tokens, topk], small)
    y: torch.Tensor  # expert output in receive order (storage released, graph root)


class ChunkedExperts(torch.autograd.Function):
    """``(hidden [T,H], probs [T,K] fp32) -> combined expert output [T,H]``, pipelined."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        indices: torch.Tensor,
        comm: Comm,
        compute: Compute,
        chunks: int,
    ) -> torch.Tensor:
        """Run the forward schedule (see the module docstring)."""
        bounds = chunk_bounds(hidden.shape[0], chunks)
        stats.add("chunks", len(bounds), call=getattr(comm, "record", None))
        # autograd disables grad mode inside forward: decide from what the caller needs
        build_graph = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        anchor = torch.zeros(
            (), device=hidden.device, requires_grad=True
        )  # makes taps differentiable
        layouts = comm.layouts([indices[slice(*b)] for b in bounds])

        def start(i: int) -> tuple:
            lo, hi = bounds[i]
            return comm.dispatch(hidden[lo:hi], indices[lo:hi], probs[lo:hi], layouts[i])

        pending = start(0)
        saved, combines = [], []
        for i in range(len(bounds)):
            following = start(i + 1) if i + 1 < len(bounds) else None
            recv_x, recv_idx, recv_probs, counts, handle, event = pending
            event.current_stream_wait()
            sink: list = []
            with torch.set_grad_enabled(build_graph):
                x = recv_x.detach()
                if build_graph:
                    x = _GradTap.apply(x, anchor, sink)
                p = recv_probs.detach().requires_grad_(build_graph)
                y = compute(x, recv_idx, p, list(counts))
            combines.append(comm.combine(y.detach(), handle))
            if build_graph and y.requires_grad:
                _release_storage(y)
            saved.append(_Chunk(handle, sink, recv_x.shape, p, y))
            del x, recv_x
            pending = following
        out = hidden.new_empty(hidden.shape)
        for (lo, hi), (combined, _, event) in zip(bounds, combines):
            event.current_stream_wait()
            out[lo:hi] = combined
        ctx.comm, ctx.bounds, ctx.chunks = comm, bounds, saved if build_graph else None
        ctx.probs_shape = probs.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        """Run the backward schedule; parameter gradients accumulate through the nested graphs."""
        comm, bounds, saved = ctx.comm, ctx.bounds, ctx.chunks
        grad_out = grad_out.contiguous()
        start = lambda i: comm.redispatch(grad_out[slice(*bounds[i])], saved[i].handle)  # noqa: E731
        pending = start(0)
        combines = []
        for i, chunk in enumerate(saved):
            following = start(i + 1) if i + 1 < len(saved) else None
            grad_y, event = pending[0], pending[-1]
            event.current_stream_wait()
            _backward_from(chunk.y, grad_y)
            grad_x = chunk.x_grad[0] if chunk.x_grad else grad_y.new_zeros(chunk.x_shape)
            grad_p = chunk.probs.grad
            grad_p = torch.zeros_like(chunk.probs) if grad_p is None else grad_p.float()
            combines.append(comm.combine(grad_x, chunk.handle, grad_p))
            pending = following
        grad_hidden = grad_out.new_empty(grad_out.shape)
        grad_probs = grad_out.new_empty(ctx.probs_shape, dtype=torch.float32)
        for (lo, hi), (gx, gp, event) in zip(bounds, combines):
            event.current_stream_wait()
            grad_hidden[lo:hi] = gx
            grad_probs[lo:hi] = gp
        ctx.chunks = None  # free the nested graphs
        return grad_hidden, grad_probs, None, None, None, None
