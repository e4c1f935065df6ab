"""The schedule orders, the offload plan and the host pool (pure Python / torch, no megatron)."""

from __future__ import annotations

import pytest
import torch
from titan_act_offload.host_pool import HostBufferPool, bucket_bytes
from titan_act_offload.plan import (
    INTERLEAVED,
    NO_PIPELINING,
    ONE_F_ONE_B,
    Event,
    Unit,
    build_plan,
    schedule_events,
)
from titan_act_offload.records import dense_span

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _order(events: list[Event]) -> str:
    return " ".join(f"{e.kind}{e.unit.chunk}{e.unit.microbatch}" for e in events)


def test_offload_1f1b_orders_per_stage():
    assert _order(schedule_events(ONE_F_ONE_B, 2, 0, 4)) == ("F00 F01 B00 F02 B01 F03 B02 B03")
    assert _order(schedule_events(ONE_F_ONE_B, 2, 1, 4)) == ("F00 B00 F01 B01 F02 B02 F03 B03")
    assert _order(schedule_events(NO_PIPELINING, 1, 0, 2)) == "F00 B00 F01 B01"
    # More stages than microbatches: everything is warmup, then all backwards.
    assert _order(schedule_events(ONE_F_ONE_B, 8, 0, 3)) == "F00 F01 F02 B00 B01 B02"


def test_offload_interleaved_order_matches_megatron_table():
    # megatron's table for PP2 VPP2 N4 (group size 2): (mb, chunk) 00 10 01 11 20 30 21 31.
    events = schedule_events(INTERLEAVED, 2, 0, 4, num_chunks=2)
    assert _order(events) == ("F00 F01 F10 F11 F02 B10 F03 B11 F12 B00 F13 B01 B12 B13 B02 B03")
    last = schedule_events(INTERLEAVED, 2, 1, 4, num_chunks=2)
    assert _order(last)[:23] == "F00 F01 F10 B10 F11 B11"


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_offload_1f1b_in_flight_is_pp_minus_stage(pp):
    for rank in range(pp):
        plan = build_plan(schedule_events(ONE_F_ONE_B, pp, rank, 8))
        assert plan.in_flight_peak() == min(pp - rank, 8)


def test_offload_plan_offloads_waiting_units_and_prefetches_before_backward():
    plan = build_plan(schedule_events(ONE_F_ONE_B, 2, 0, 4), min_gap=2)
    assert [plan.gap(Unit(0, m)) for m in range(4)] == [1, 2, 2, 1]
    assert plan.offload == {Unit(0, 1), Unit(0, 2)}
    # Each offloaded unit comes back during the event before its backward, in backward order.
    assert plan.prefetch_at == {3: [Unit(0, 1)], 5: [Unit(0, 2)]}
    assert plan.in_flight_peak() == 2 and plan.in_flight_peak(kept_only=True) == 1
    assert plan.resident_peak(lambda u: 10) == 10
    # Last stage: backward right after forward; MIN_GAP=0 prefetches at the backward itself.
    last = build_plan(schedule_events(ONE_F_ONE_B, 2, 1, 2), min_gap=0)
    assert last.offload == {Unit(0, 0), Unit(0, 1)}
    assert last.prefetch_at == {1: [Unit(0, 0)], 3: [Unit(0, 1)]}
    assert build_plan(schedule_events(ONE_F_ONE_B, 2, 1, 2)).offload == frozenset()


def test_offload_plan_host_budget_prefers_longest_waits():
    events = schedule_events(ONE_F_ONE_B, 4, 0, 8)
    size = dict.fromkeys((e.unit for e in events), 100)
    unlimited = build_plan(events, unit_bytes=size, host_budget=None)
    assert len(unlimited.offload) == 8 and unlimited.host_peak(size) == 400
    plan = build_plan(events, unit_bytes=size, host_budget=200)
    assert plan.host_peak(size) <= 200 and plan.offload
    longest = max(unlimited.gap(u) for u in size)
    assert any(plan.gap(u) == longest for u in plan.offload)
    with pytest.raises(ValueError, match="min_gap"):
        build_plan(events, min_gap=-1)
    with pytest.raises(ValueError, match="kind"):
        schedule_events("zero_bubble", 2, 0, 4)


def test_offload_host_pool_buckets_reuse_and_budget():
    for n in (1, 511, 4097, 70_000, 5 << 20):
        b = bucket_bytes(n)
        assert n <= b <= max(512, n * 1.125 + 512)
    pool = HostBufferPool(budget=4096)
    a = pool.acquire(1000)
    assert a is not None and a.numel() == 1024 and pool.in_use == 1024
    pool.release(a)
    assert pool.acquire(900) is a and pool.reuses == 1  # same bucket: reused
    assert pool.acquire(3500) is None and pool.refusals == 1  # 1024 + 3584 > 4096
    pool.release(a)
    big = pool.acquire(3000)  # evicts the free 1 KiB buffer to fit
    assert big is not None and pool.capacity <= 4096


def test_offload_dense_span():
    x = torch.zeros(4, 6)
    assert dense_span(x) and dense_span(x.t()) and dense_span(x.view(2, 2, 6).permute(2, 0, 1))
    assert not dense_span(x[:, :3]) and not dense_span(torch.zeros(4, 1).expand(4, 6))
