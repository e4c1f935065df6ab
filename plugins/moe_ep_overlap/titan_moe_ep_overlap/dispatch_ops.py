"""The transfers behind ``Buffer.dispatch`` / ``Buffer.combine``: start them, finish them later.

Each function only *starts* all-to-alls and returns the output tensors plus the works (and, for
combine, a finaliser doing the per-token reduction); the caller wraps them in an ``EventHandle``.
Remapping of expert ids to local ids is done on the sending side (the sender knows the destination
rank), so dispatch results need no post-processing and are valid as soon as the works complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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
    """Outputs of a fresh dispatch whose transfers are in flight."""

    recv_x: Tensors
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert_list: list[int]
    handle: Handle
    works: list[Any]
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

        works, recv_parts = [], []
        for part in _parts(x):
            out = part.new_zeros((rows, *part.shape[1:])) if rows > received else None
            recv, work = all_to_all_rows(
                part[plan.token_idx], recv_counts, plan.send_counts, group, out=out
            )
            recv_parts.append(recv)
            works.append(work)

        # local expert ids for the destination (-1: expert not on that rank), source index and
        # weights travel in one int32 all-to-all (one collective instead of three)
        chosen = topk_idx[plan.token_idx]
        local = chosen - plan.dest.unsqueeze(1) * per_rank
        on_dest = (chosen >= 0) & (local >= 0) & (local < per_rank)
        local = torch.where(on_dest, local, torch.full_like(local, -1))
        meta = torch.cat([local, plan.token_idx.unsqueeze(1)], dim=1).to(torch.int64)
        weights = None
        if topk_weights is not None:
            weights = topk_weights[plan.token_idx].masked_fill(~on_dest, 0.0)
        packed = _pack_meta(meta, weights)
        packed_out = packed.new_full((rows, packed.shape[1]), 0)
        packed_out[:, : 2 * meta.shape[1]] = -1  # padding rows (num_worst_tokens): index -1
        recv_packed, work = all_to_all_rows(
            packed, recv_counts, plan.send_counts, group, out=packed_out
        )
        works.append(work)
        recv_meta, recv_weights = _unpack_meta(recv_packed, meta.shape[1], weights is not None)
        keep: list[Any] = [packed]
        k = topk_idx.shape[1]
        recv_src_idx = recv_meta[:received, k]
        handle = make_handle(rank_prefix_matrix, me, recv_src_idx, is_token_in_rank, plan)
        return cls(
            recv_x=_like(x, recv_parts),
            recv_topk_idx=recv_meta[:, :k],
            recv_topk_weights=recv_weights,
            num_recv_tokens_per_expert_list=[] if num_worst_tokens > 0 else aligned,
            handle=handle,
            works=works,
            keep_alive=(*keep, *recv_parts, recv_packed),
        )


def _pack_meta(meta: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[n, 2*(K+1) (+K) (+pad)]`` int32 rows: int64 ids as int32 pairs, fp32 weights as bits.

    The width is even so the receiver can view the id columns back as int64 without a copy.
    """
    parts = [meta.contiguous().view(torch.int32)]
    if weights is not None:
        parts.append(weights.contiguous().view(torch.int32))
    width = sum(p.shape[1] for p in parts)
    if width % 2:
        parts.append(meta.new_zeros((meta.shape[0], 1), dtype=torch.int32))
    return torch.cat(parts, dim=1)


def _unpack_meta(
    packed: torch.Tensor, meta_cols: int, has_weights: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Views of the received ids (int64 ``[n, K+1]``) and weights (fp32 ``[n, K]``)."""
    ids = packed[:, : 2 * meta_cols].view(torch.int64)
    if not has_weights:
        return ids, None
    return ids, packed[:, 2 * meta_cols : 2 * meta_cols + meta_cols - 1].view(torch.float32)


def dispatch_rows(
    x: Tensors, handle: Handle, group: dist.ProcessGroup, rank: int
) -> tuple[Tensors, list[Any]]:
    """Cached dispatch: send rows of ``x`` exactly as the dispatch that produced ``handle``."""
    plan, rank_prefix_matrix = plan_from_handle(handle)
    recv_counts = recv_counts_from(rank_prefix_matrix, rank)
    outs, works = [], []
    for part in _parts(x):
        out, work = all_to_all_rows(part[plan.token_idx], recv_counts, plan.send_counts, group)
        outs.append(out)
        works.append(work)
    return _like(x, outs), works


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
    back, work = all_to_all_rows(x[:received], plan.send_counts, recv_counts, group)
    works = [work]
    combined = x.new_empty((num_tokens, *x.shape[1:]))
    back_w = combined_w = None
    if topk_weights is not None:
        back_w, work = all_to_all_rows(
            topk_weights[:received], plan.send_counts, recv_counts, group
        )
        works.append(work)
        combined_w = topk_weights.new_empty((num_tokens, *topk_weights.shape[1:]))
    biases = _parts(bias) if bias is not None else ()

    def finalize() -> None:
        _sum_into(combined, back, plan.token_idx, plan.send_counts, biases)
        if combined_w is not None:
            _sum_into(combined_w, back_w, plan.token_idx, plan.send_counts, ())

    return combined, combined_w, works, finalize, (x, back, back_w)


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
