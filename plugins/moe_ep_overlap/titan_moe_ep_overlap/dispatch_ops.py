"""The transfers behind ``Buffer.dispatch`` / ``Buffer.combine``: start them, finish them later.

Each function only *starts* one all-to-all (tokens and their metadata packed side by side, see
``rowpack``) and returns the output tensors, the work and a finaliser (dispatch: copy the packed
rows out into contiguous results; combine: the per-token reduction); the caller wraps them in an
``EventHandle``. Expert ids are remapped to local ids on the sending side (the sender knows the
destination rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from titan_moe_ep_overlap import rowpack
from titan_moe_ep_overlap.comm import all_to_all_rows
from titan_moe_ep_overlap.layout import (
    Handle,
    make_handle,
    plan_from_handle,
    recv_counts_from,
    send_plan,
)

Tensors = torch.Tensor | tuple[torch.Tensor, ...]


def _parts(x: Tensors) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _like(x: Tensors, parts: list[torch.Tensor]) -> Tensors:
    return tuple(parts) if isinstance(x, (tuple, list)) else parts[0]


@dataclass
class DispatchResult:
    """Outputs of a fresh dispatch whose transfer is in flight (valid after ``finalize``)."""

    recv_x: Tensors
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert_list: list[int]
    handle: Handle
    works: list[Any]
    finalize: Callable[[], None]
    keep_alive: tuple[Any, ...]

    @classmethod
    def start(
        cls,
        x: Tensors,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        is_token_in_rank: torch.Tensor,
        table: torch.Tensor,
        buffer: Any,
        expert_alignment: int,
        num_worst_tokens: int,
    ) -> DispatchResult:
        """Start a dispatch; ``table[r] = [tokens rank r sends to each rank, per expert]``."""
        if topk_weights is not None and topk_weights.dtype != torch.float32:
            raise TypeError(
                f"dispatch takes float32 topk_weights (as DeepEP), got {topk_weights.dtype}"
            )
        ranks, me, group = buffer.group_size, buffer.rank, buffer.group
        per_rank = (table.shape[1] - ranks) // ranks  # local experts per rank
        rank_prefix_matrix = torch.cumsum(table[:, :ranks], 0).to(torch.int32)
        recv_counts = [int(c) for c in table[:, me].tolist()]
        received = sum(recv_counts)
        first = ranks + me * per_rank
        per_expert = table[:, first : first + per_rank].sum(0).tolist()
        align = max(int(expert_alignment), 1)
        aligned = [-(-int(c) // align) * align for c in per_expert]
        plan = send_plan(is_token_in_rank)
        rows = max(received, int(num_worst_tokens))

        # local expert ids for the destination (-1: expert not on that rank) and source index
        chosen = topk_idx[plan.token_idx]
        local = chosen - plan.dest.unsqueeze(1) * per_rank
        on_dest = (chosen >= 0) & (local >= 0) & (local < per_rank)
        local = torch.where(on_dest, local, torch.full_like(local, -1))
        meta = torch.cat([local, plan.token_idx.unsqueeze(1)], dim=1).to(torch.int64)
        parts = [part[plan.token_idx] for part in _parts(x)] + [meta]
        if topk_weights is not None:
            parts.append(topk_weights[plan.token_idx].masked_fill(~on_dest, 0.0))
        layout = rowpack.layout_of(parts)
        packed = rowpack.pack(parts, layout)
        out = packed.new_zeros((rows, packed.shape[1])) if rows > received else None
        recv, work = all_to_all_rows(packed, recv_counts, plan.send_counts, group, out=out)
        results = [p.new_empty((rows, p.shape[1])) for p in parts]

        def finalize() -> None:
            for dst, src in zip(results, rowpack.views(recv, layout)):
                dst.copy_(src)
            results[len(_parts(x))][received:] = -1  # num_worst_tokens padding rows: no expert

        k = topk_idx.shape[1]
        recv_meta = results[len(_parts(x))]
        handle = make_handle(
            rank_prefix_matrix, me, recv_meta[:received, k], is_token_in_rank, plan
        )
        return cls(
            recv_x=_like(x, results[: len(_parts(x))]),
            recv_topk_idx=recv_meta[:, :k],
            recv_topk_weights=results[-1] if topk_weights is not None else None,
            num_recv_tokens_per_expert_list=[] if num_worst_tokens > 0 else aligned,
            handle=handle,
            works=[work],
            finalize=finalize,
            keep_alive=(packed, recv),
        )


def dispatch_rows(
    x: Tensors, handle: Handle, group: dist.ProcessGroup, rank: int
) -> tuple[Tensors, list[Any], Callable[[], None] | None]:
    """Cached dispatch: send rows of ``x`` exactly as the dispatch that produced ``handle``."""
    plan, rank_prefix_matrix = plan_from_handle(handle)
    recv_counts = recv_counts_from(rank_prefix_matrix, rank)
    parts = [part[plan.token_idx] for part in _parts(x)]
    if len(parts) == 1:
        out, work = all_to_all_rows(parts[0], recv_counts, plan.send_counts, group)
        return _like(x, [out]), [work], None
    layout = rowpack.layout_of(parts)
    recv, work = all_to_all_rows(rowpack.pack(parts, layout), recv_counts, plan.send_counts, group)
    results = [p.new_empty((recv.shape[0], p.shape[1])) for p in parts]

    def finalize() -> None:
        for dst, src in zip(results, rowpack.views(recv, layout)):
            dst.copy_(src)

    return _like(x, results), [work], finalize


def combine_rows(
    x: torch.Tensor,
    handle: Handle,
    topk_weights: torch.Tensor | None,
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None,
    group: dist.ProcessGroup,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor | None, list[Any], Callable[[], None], tuple[Any, ...]]:
    """Start a combine: rows of ``x`` (in this rank's receive order) go back to their sources.

    The finaliser sums the returned copies per token in fp32, rank by rank in rank order (so the
    summation order is the ascending expert order), adds the bias, and casts to ``x.dtype``.
    """
    plan, rank_prefix_matrix = plan_from_handle(handle)
    recv_counts = recv_counts_from(rank_prefix_matrix, rank)
    received = sum(recv_counts)
    num_tokens = handle[4].shape[0]
    parts = [x[:received]] + ([topk_weights[:received]] if topk_weights is not None else [])
    layout = rowpack.layout_of(parts)
    packed = rowpack.pack(parts, layout) if len(parts) > 1 else parts[0]
    back, work = all_to_all_rows(packed, plan.send_counts, recv_counts, group)
    combined = x.new_empty((num_tokens, *x.shape[1:]))
    combined_w = None
    if topk_weights is not None:
        combined_w = topk_weights.new_empty((num_tokens, *topk_weights.shape[1:]))
    biases = _parts(bias) if bias is not None else ()

    def finalize() -> None:
        got = rowpack.views(back, layout) if len(parts) > 1 else [back]
        _sum_into(combined, got[0], plan.token_idx, plan.send_counts, biases)
        if combined_w is not None:
            _sum_into(combined_w, got[1], plan.token_idx, plan.send_counts, ())

    return combined, combined_w, [work], finalize, (packed, back)


def _sum_into(
    out: torch.Tensor,
    rows: torch.Tensor,
    token_idx: torch.Tensor,
    counts: list[int],
    biases: tuple[torch.Tensor, ...],
) -> None:
    acc = (
        out
        if out.dtype == torch.float32
        else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    )
    acc.zero_()
    start = 0
    for count in counts:  # one rank at a time: indices are unique within a rank
        if count:
            part = rows[start : start + count].to(torch.float32)
            acc.index_add_(0, token_idx[start : start + count], part)
        start += count
    for b in biases:
        acc.add_(b.to(torch.float32))
    if acc is not out:
        out.copy_(acc)
