"""The torch.distributed DeepEP-v1 backend against a dense reference, on gloo (EP=2 and EP=4).

Every rank draws its own tokens and routing (uneven splits, tokens routed nowhere, experts and
whole ranks receiving nothing), then the task checks dispatch, cached dispatch and combine
bit-for-bit against the same quantities computed densely from everyone's inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

# (tokens, hidden, experts, topk, fraction of topk slots set to -1, dtype, async, alignment, worst)
CASES = [
    (13, 16, 4, 2, 0.0, torch.float32, False, 1, 0),
    (17, 8, 8, 8, 0.2, torch.float32, True, 1, 0),
    (9, 16, 8, 1, 0.5, torch.bfloat16, True, 4, 0),
    (0, 16, 4, 2, 0.0, torch.float32, True, 1, 0),  # a rank without tokens
    (11, 16, 4, 2, 0.1, torch.float32, True, 1, 64),  # num_worst_tokens padding
    (7, 4, 12, 3, 1.0, torch.float32, True, 1, 0),  # nothing routed anywhere
]


def _routing(tokens: int, experts: int, topk: int, drop: float, gen: torch.Generator):
    rows = [torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]
    idx = torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int64)
    mask = torch.rand(idx.shape, generator=gen) < drop
    idx = idx.masked_fill(mask, -1)
    weights = torch.rand(idx.shape, generator=gen).masked_fill(mask, 0.0)
    return idx, weights.float()


def _gather(obj: object) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_case(case: tuple, seed: int) -> None:
    from titan_moe_ep_overlap.buffer import Buffer

    tokens, hidden, experts, topk, drop, dtype, async_finish, align, worst = case
    group = dist.group.WORLD
    me, ranks = dist.get_rank(), dist.get_world_size()
    local = experts // ranks
    gen = torch.Generator().manual_seed(seed * 100 + me)
    n_tok = tokens + me * 3 if tokens else (0 if me == 0 else 5)  # uneven token counts
    x = torch.randn(n_tok, hidden, generator=gen).to(dtype)
    idx, weights = _routing(n_tok, experts, topk, drop, gen)
    buffer = Buffer(group, 0, 0)
    per_rank, rdma, per_expert, in_rank, ev = buffer.get_dispatch_layout(idx, experts)
    assert rdma is None and ev.event is None
    prev = buffer.capture() if async_finish else None
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=align,
        num_worst_tokens=worst, previous_event=prev, async_finish=async_finish,
        allocate_on_comm_stream=async_finish,
    )  # fmt: skip
    assert (event.event is not None) == async_finish
    if async_finish:
        event.current_stream_wait()

    everyone = _gather((x, idx, weights))
    exp_x, exp_idx, exp_w, exp_src = [], [], [], []
    for src, (xs, ids, ws) in enumerate(everyone):
        for t in range(xs.shape[0]):
            lid = ids[t] - me * local
            on_me = (ids[t] >= 0) & (lid >= 0) & (lid < local)
            if on_me.any():
                exp_x.append(xs[t])
                exp_idx.append(torch.where(on_me, lid, torch.full_like(lid, -1)))
                exp_w.append(torch.where(on_me, ws[t], torch.zeros_like(ws[t])))
                exp_src.append((src, t))
    n = len(exp_x)
    stack = lambda rows, like: torch.stack(rows) if rows else like.new_zeros((0, *like.shape[1:]))  # noqa: E731
    assert torch.equal(recv_x[:n], stack(exp_x, x))
    assert torch.equal(recv_idx[:n], stack(exp_idx, idx))
    assert torch.equal(recv_w[:n], stack(exp_w, weights))
    assert handle[3].tolist() == [t for _, t in exp_src]
    if worst:
        assert recv_x.shape[0] == max(n, worst) and counts == []
        assert bool((recv_idx[n:] == -1).all())
    else:
        assert recv_x.shape[0] == n
        true_counts = [int((recv_idx == e).sum()) for e in range(local)]
        assert counts == [-(-c // align) * align for c in true_counts]

    # combine: each rank scales what it received; the sum per token is checked in rank order
    y = recv_x * (me + 2)
    prev = buffer.capture() if async_finish else None
    combined, combined_w, event = buffer.combine(
        y, handle, topk_weights=recv_w, previous_event=prev, async_finish=async_finish,
        allocate_on_comm_stream=async_finish,
    )  # fmt: skip
    if async_finish:
        event.current_stream_wait()
    ref = torch.zeros(n_tok, hidden, dtype=torch.float32)
    for r in range(ranks):
        owner = (idx >= 0) & (idx // local == r)
        rows = owner.any(1)
        ref[rows] += (x[rows] * (r + 2)).float()
    assert torch.equal(combined, ref.to(dtype))
    assert torch.equal(combined_w, weights)

    # cached dispatch (what megatron's FusedCombine.backward does)
    grad = torch.randn(n_tok, hidden, generator=gen).to(dtype)
    g_recv, none1, none2, none3, none4, event = buffer.dispatch(grad, handle=handle)
    assert none1 is None and none2 is None and none3 is None and none4 is None
    grads = _gather(grad)
    assert torch.equal(g_recv, stack([grads[s][t] for s, t in exp_src], grad))


def task_backend_cases(cases: list[tuple], seed: int) -> int:
    """Run every case on this rank; returns the number checked."""
    for i, case in enumerate(cases):
        _check_case(case, seed + i)
    return len(cases)


def task_fp8_and_events(seed: int) -> bool:
    """fp8 tuples travel bit-exact; previous_event orders after pending comm; rule errors."""
    from titan_moe_ep_overlap.buffer import Buffer
    from titan_moe_ep_overlap.events import EventOverlap

    me = dist.get_rank()
    gen = torch.Generator().manual_seed(seed + me)
    buffer = Buffer(dist.group.WORLD)
    x = torch.randn(6, 32, generator=gen)
    data, scales = x.to(torch.float8_e4m3fn), torch.rand(6, 1, generator=gen)
    idx, weights = _routing(6, 4, 2, 0.0, gen)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 4)
    (recv_data, recv_scales), _, _, _, handle, event = buffer.dispatch(
        (data, scales), topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, async_finish=True,
    )  # fmt: skip
    # a later op with previous_event=<pending dispatch> completes it first
    combined, _, ev2 = buffer.combine(
        recv_data.view(torch.uint8).float(), handle, previous_event=event, async_finish=True
    )
    assert event.event.completed
    with ev2:
        pass
    assert ev2.event.completed
    theirs = _gather((data.view(torch.uint8), scales, idx))
    rows = [
        (d[t], s[t]) for d, s, i in theirs for t in range(d.shape[0])
        if ((i[t] >= 0) & (i[t] // 2 == me)).any()
    ]  # fmt: skip
    assert torch.equal(recv_data.view(torch.uint8), torch.stack([r[0] for r in rows]))
    assert torch.equal(recv_scales, torch.stack([r[1] for r in rows]))
    with pytest.raises(AssertionError, match="allocate_on_comm_stream"):
        buffer.combine(combined, handle, allocate_on_comm_stream=True)
    with pytest.raises(AssertionError, match="needs an event"):
        EventOverlap().current_stream_wait()
    return True


def task_bad_expert_count() -> str:
    """Experts not divisible by the EP size: a ValueError that names the fix; low-latency mode is
    refused with a message naming DeepEP."""
    from titan_moe_ep_overlap.buffer import Buffer

    buffer = Buffer(dist.group.WORLD)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="low-latency mode is not provided"):
        Buffer(dist.group.WORLD, low_latency_mode=True)
    with pytest.raises(NotImplementedError, match="DeepEP v1.x"):
        buffer.low_latency_dispatch(idx)
    with pytest.raises(ValueError) as info:
        buffer.get_dispatch_layout(idx, dist.get_world_size() * 2 + 1)
    return str(info.value)


def test_backend_matches_dense_reference_ep2(gloo_pool2) -> None:
    assert gloo_pool2.run(task_backend_cases, CASES, 1) == [len(CASES)] * 2
    assert gloo_pool2.run(task_fp8_and_events, 7) == [True, True]
    message = gloo_pool2.run(task_bad_expert_count)[0]
    assert "5 experts" in message and "--num-experts" in message


def test_backend_matches_dense_reference_ep4(gloo_pool4) -> None:
    assert gloo_pool4.run(task_backend_cases, CASES, 2) == [len(CASES)] * 4
