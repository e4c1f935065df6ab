"""An engine with tp_size > 1: TP rank 0 sends the verified landing region to the other ranks in
buckets, and every rank loads every tensor bit for bit; a refusal, a rank with no room for a
bucket and a rank whose loader fails end the same way on every rank, without a hang. Run on two
gloo ranks standing for two SGLang scheduler processes (the SGLang legs run it in real TP=2
engines: test_weight_sync_engine.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from titan_weight_sync import engine_tp, layout
from titan_weight_sync.errors import WeightSyncError

from titan_plugins.hosts.megatron.testing import tiny_gpt

pytestmark = pytest.mark.multiprocess

ENTRIES = [
    ("a.weight", "BF16", (7, 5)),
    ("b.bias", "F32", (3,)),
    ("big.weight", "F32", (40, 3)),  # 480 B: larger than the cap below
    ("empty", "F32", (0,)),
    ("z.norm", "I8", (70,)),
]
CAP = 256


def _table() -> tuple[list[layout.Slot], dict[str, torch.Tensor]]:
    slots = layout.build_table(ENTRIES)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for slot in slots:
        dtype = layout.DTYPES[slot.dtype]
        if dtype.is_floating_point:
            tensors[slot.name] = torch.randn(slot.shape, generator=generator).to(dtype)
        else:
            tensors[slot.name] = torch.randint(-100, 100, slot.shape, generator=generator).to(dtype)
    return slots, tensors


def test_buckets_keep_the_order_stay_under_the_cap_and_hold_a_large_tensor_alone() -> None:
    slots, _ = _table()
    plan = engine_tp.buckets(slots, CAP)
    assert [s.name for b in plan for s in b.slots] == [s.name for s in slots]
    for bucket in plan:
        assert bucket.start == bucket.slots[0].offset
        assert bucket.end == bucket.slots[-1].offset + bucket.slots[-1].nbytes
        assert bucket.end - bucket.start <= CAP or len(bucket.slots) == 1
    assert [b.slots for b in plan if b.end - b.start > CAP] == [(slots[2],)]
    assert len(plan) == 3
    assert engine_tp.buckets([], CAP) == []


def fanout_task(case: str) -> dict:
    """Two ranks as one engine's TP group: rank 0 leads with a landing region holding the
    table's tensors, rank 1 follows; each returns what its loader got and how it ended."""
    tiny_gpt.init_parallel()
    rank = torch.distributed.get_rank()
    world = torch.distributed.group.WORLD
    group = SimpleNamespace(
        rank_in_group=rank, world_size=2, cpu_group=world, device_group=world,
        device=torch.device("cpu"),
    )  # fmt: skip
    slots, tensors = _table()
    loaded: list[tuple[str, torch.Tensor]] = []
    calls = [0]

    def load(named: list[tuple[str, torch.Tensor]]) -> int:
        calls[0] += 1
        if case == "rank1_fails" and rank == 1 and calls[0] == 2:
            raise RuntimeError("the loader broke on this bucket")
        loaded.extend((name, tensor.clone()) for name, tensor in named)
        return len(named)

    limit = os.environ.get("TITAN_PLUGINS_MAX_HOST_BYTES")
    if case == "rank1_no_room" and rank == 1:
        os.environ["TITAN_PLUGINS_MAX_HOST_BYTES"] = "64"  # smaller than the largest bucket
    outcome = "done"
    try:
        if rank == 0:
            region = torch.zeros(layout.region_bytes(slots), dtype=torch.uint8)
            for slot in slots:
                layout.view(region, slot).copy_(tensors[slot.name])
            endpoint = SimpleNamespace(landing=SimpleNamespace(region=region), slots=slots)
            leader = engine_tp.Leader(group, endpoint, CAP, load)
            try:
                if case != "refused":
                    leader.load([(s.name, layout.view(region, s)) for s in slots])
            finally:
                leader.finish()
        else:
            outcome = "loaded" if engine_tp.follow(group, slots, load) else "skipped"
    except WeightSyncError as err:
        outcome = f"error: {err}"
    finally:
        if limit is None:
            os.environ.pop("TITAN_PLUGINS_MAX_HOST_BYTES", None)
        else:
            os.environ["TITAN_PLUGINS_MAX_HOST_BYTES"] = limit
    same = [
        name for name, tensor in loaded
        if torch.equal(tensor.view(torch.uint8), tensors[name].view(torch.uint8))
    ]  # fmt: skip
    return {"outcome": outcome, "names": [n for n, _ in loaded], "bit_equal": same}


def test_every_rank_loads_every_tensor_bit_for_bit(gloo_pool2) -> None:
    leader, follower = gloo_pool2.run(fanout_task, "load")
    names = [name for name, _, _ in ENTRIES]
    assert leader == {"outcome": "done", "names": names, "bit_equal": names}
    assert follower == {"outcome": "loaded", "names": names, "bit_equal": names}


def test_a_refused_message_loads_nothing_anywhere(gloo_pool2) -> None:
    leader, follower = gloo_pool2.run(fanout_task, "refused")
    assert leader["names"] == [] and follower == {"outcome": "skipped", "names": [],
                                                    "bit_equal": []}  # fmt: skip


def test_a_rank_without_room_for_a_bucket_stops_the_load_before_any_rank_loads(gloo_pool2):
    leader, follower = gloo_pool2.run(fanout_task, "rank1_no_room")
    for result in (leader, follower):
        assert result["names"] == []
        assert result["outcome"].startswith(
            "error: TP rank 1: no room for a bucket: need 480 bytes"
        )
        assert "nothing was loaded" in result["outcome"]


def test_a_rank_whose_loader_fails_fails_the_commit_on_every_rank(gloo_pool2) -> None:
    leader, follower = gloo_pool2.run(fanout_task, "rank1_fails")
    for result in (leader, follower):
        assert result["outcome"].startswith(
            "error: SGLang's loader failed on TP rank 1: RuntimeError: the loader broke on this "
            "bucket; the other ranks loaded, so the engine's ranks now hold different weights"
        )
    assert leader["names"] == [name for name, _, _ in ENTRIES]  # rank 0 went on sending
    assert follower["names"] == ["a.weight", "b.bias"]  # the first bucket, then the failure
