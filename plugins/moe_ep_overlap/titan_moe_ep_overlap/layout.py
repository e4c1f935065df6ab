"""Routing layout math of DeepEP v1 (``get_dispatch_layout`` and the dispatch handle), pure torch.

Conventions (DeepEP's): rank r owns experts ``[r*E/R, (r+1)*E/R)``; ``topk_idx == -1`` means
"no expert"; a token is sent once to every rank that owns at least one of its experts; received
rows are ordered by source rank, then by source token index.

Our handle is DeepEP's intranode 6-tuple with one "channel" per rank pair:
``(rank_prefix_matrix[R,R] int32, channel_prefix_matrix[R,1] int32,
recv_channel_prefix_matrix[R,1] int32, recv_src_idx[N_recv] int64, is_token_in_rank[T,R] bool,
send_head[T,R] int32)``. ``rank_prefix_matrix[s, d]`` counts the tokens ranks ``0..s`` send to
``d``; ``send_head[t, r]`` is the position of token t among the rows sent to r (-1: not sent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Handle = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_num_experts(num_experts: int, num_ranks: int) -> None:
    """Raise a clear error when experts cannot be split evenly over the EP ranks."""
    if num_experts <= 0 or num_experts % num_ranks != 0:
        raise ValueError(
            f"moe_ep_overlap: {num_experts} experts cannot be split evenly over {num_ranks} "
            f"expert-parallel ranks. Choose --num-experts as a multiple of the EP size (x TP size "
            f"for the flex dispatcher), or change --expert-model-parallel-size."
        )


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank int32[R], num_tokens_per_expert int32[E], is_token_in_rank[T,R])``."""
    check_num_experts(num_experts, num_ranks)
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [num_tokens, num_topk], got {tuple(topk_idx.shape)}")
    per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    experts = topk_idx[valid]
    num_tokens_per_expert = torch.bincount(experts, minlength=num_experts).to(torch.int32)
    is_token_in_rank = torch.zeros(
        (topk_idx.shape[0], num_ranks), dtype=torch.bool, device=topk_idx.device
    )
    rows = torch.arange(topk_idx.shape[0], device=topk_idx.device)
    rows = rows.unsqueeze(1).expand_as(topk_idx)[valid]
    is_token_in_rank[rows, experts // per_rank] = True
    num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


@dataclass
class SendPlan:
    """Which token goes where: rows ``token_idx`` (rank-major), their ``dest`` rank, counts."""

    token_idx: torch.Tensor  # int64 [n_send]
    dest: torch.Tensor  # int64 [n_send]
    send_counts: list[int]  # rows per destination rank
    send_head: torch.Tensor  # int32 [T, R]


def send_plan(is_token_in_rank: torch.Tensor) -> SendPlan:
    """Send order of a dispatch: for each rank in order, its tokens in token order."""
    pairs = is_token_in_rank.t().nonzero()  # (rank, token), sorted rank-major
    dest, token_idx = pairs[:, 0], pairs[:, 1]
    counts = is_token_in_rank.sum(0)
    starts = torch.cumsum(counts, 0) - counts
    send_head = torch.full(
        is_token_in_rank.shape, -1, dtype=torch.int32, device=is_token_in_rank.device
    )
    position = torch.arange(token_idx.numel(), device=token_idx.device) - starts[dest]
    send_head[token_idx, dest] = position.to(torch.int32)
    return SendPlan(token_idx, dest, [int(c) for c in counts.tolist()], send_head)


def make_handle(
    rank_prefix_matrix: torch.Tensor,
    rank: int,
    recv_src_idx: torch.Tensor,
    is_token_in_rank: torch.Tensor,
    plan: SendPlan,
) -> Handle:
    """Assemble the 6-tuple handle (see module docstring)."""
    channel_prefix = torch.cumsum(torch.tensor(plan.send_counts, dtype=torch.int32), 0)
    recv_counts = recv_counts_from(rank_prefix_matrix, rank)
    recv_channel_prefix = torch.cumsum(torch.tensor(recv_counts, dtype=torch.int32), 0)
    return (
        rank_prefix_matrix,
        channel_prefix.view(-1, 1).to(torch.int32),
        recv_channel_prefix.view(-1, 1).to(torch.int32),
        recv_src_idx,
        is_token_in_rank,
        plan.send_head,
    )


def recv_counts_from(rank_prefix_matrix: torch.Tensor, rank: int) -> list[int]:
    """Rows this rank receives from each source rank (differences down column ``rank``)."""
    column = rank_prefix_matrix[:, rank].to(torch.int64)
    previous = torch.cat([column.new_zeros(1), column[:-1]])
    return [int(c) for c in (column - previous).tolist()]


def plan_from_handle(handle: Handle) -> tuple[SendPlan, torch.Tensor]:
    """Recover the send plan and ``rank_prefix_matrix`` of an earlier dispatch from its handle."""
    if not isinstance(handle, tuple) or len(handle) != 6:
        raise TypeError(
            "moe_ep_overlap: this handle is not an intranode handle of the torch.distributed "
            "backend (a 6-tuple); pass the handle returned by this backend's dispatch"
        )
    rank_prefix_matrix, _, _, _, is_token_in_rank, send_head = handle
    pairs = is_token_in_rank.t().nonzero()
    counts = [int(c) for c in is_token_in_rank.sum(0).tolist()]
    return SendPlan(pairs[:, 1], pairs[:, 0], counts, send_head), rank_prefix_matrix
