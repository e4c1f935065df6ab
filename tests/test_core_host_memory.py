"""The plugins' shared host-memory ledger: one limit over act_offload's pool and rewind's
snapshots (and any later plugin that parks data in host RAM)."""

from __future__ import annotations

import gc

import pytest
import torch

from titan_plugins import host_memory

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


@pytest.fixture(autouse=True)
def small_limit(monkeypatch):
    monkeypatch.setenv("TITAN_PLUGINS_MAX_HOST_BYTES", "64K")
    gc.collect()  # reservations of earlier tests' discarded objects are released
    yield
    gc.collect()


def test_reserve_and_release_under_the_limit():
    base = host_memory.usage()["total"]
    assert host_memory.limit() == 64 << 10
    assert host_memory.reserve("a", 40 << 10)
    assert not host_memory.reserve("b", (24 << 10) + 1 - base)  # one byte too many: nothing held
    assert host_memory.usage().get("b", 0) == 0
    host_memory.release("a", 40 << 10)
    assert host_memory.usage()["total"] == base


def test_a_reservation_is_released_when_its_owner_goes_away():
    reservation = host_memory.Reservation("pool")
    assert reservation.grow(32 << 10) and reservation.held == 32 << 10
    assert host_memory.usage()["pool"] == 32 << 10
    del reservation
    gc.collect()
    assert "pool" not in host_memory.usage()


def test_the_default_limit_is_a_share_of_ram_per_local_rank(monkeypatch):
    monkeypatch.delenv("TITAN_PLUGINS_MAX_HOST_BYTES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ram = host_memory.physical_memory() or 64 << 30
    assert host_memory.limit() == int(ram * host_memory.SHARE_OF_RAM) // 4


def test_act_offload_pool_and_rewind_snapshots_share_the_limit():
    from titan_act_offload.host_pool import HostBufferPool
    from titan_rewind.store import SnapshotStore

    pool = HostBufferPool(budget=None)
    held = [pool.acquire(16 << 10) for _ in range(3)]  # 48K of the 64K
    assert all(b is not None for b in held)
    store = SnapshotStore(interval=1, stable_after=1, budget=1 << 30)
    chunks = [torch.nn.Linear(64, 64, bias=False)]  # 16 KiB of fp32 weights, no optimizer state
    assert not store._fits(chunks, None)  # two snapshots need 32K: only 16K are left
    assert "TITAN_PLUGINS_MAX_HOST_BYTES" in store.no_snapshot
    assert "act_offload 48 KiB (49,152 bytes)" in store.no_snapshot  # who holds what
    for buffer in held:
        pool.release(buffer)
    pool.clear()  # act_offload gives its idle buffers back: rewind now fits
    store.no_snapshot = ""
    assert store._fits(chunks, None) and store.ledger.held == 32 << 10
    assert pool.acquire(48 << 10) is None  # and now the pool is the one refused
    assert pool.stats()["shared_refusals"] == 1


def test_a_refusal_says_the_sizes_once_readable_and_exact_and_names_the_knob():
    base = host_memory.usage()["total"]
    assert host_memory.reserve("act_offload", (48 << 10) - base)
    try:
        message = host_memory.shortfall(10328280)
    finally:
        host_memory.release("act_offload", (48 << 10) - base)
    assert message.startswith(
        "need 9.85 MiB (10,328,280 bytes) but only 16 KiB (16,384 bytes) of "
        "TITAN_PLUGINS_MAX_HOST_BYTES=64K remain"
    ), message
    assert "10328280" not in message and "act_offload" in message
    assert "raise TITAN_PLUGINS_MAX_HOST_BYTES" in message


def test_a_refusal_under_the_default_limit_says_how_it_was_computed(monkeypatch):
    monkeypatch.delenv("TITAN_PLUGINS_MAX_HOST_BYTES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    message = host_memory.shortfall(1 << 60)
    assert message.startswith("need 1048576 TiB (1,152,921,504,606,846,976 bytes) but only ")
    assert "TITAN_PLUGINS_MAX_HOST_BYTES unset: 60% of RAM / 8 local ranks" in message


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0 bytes"),
        (512, "512 bytes"),
        (65536, "64 KiB (65,536 bytes)"),
        (10328280, "9.85 MiB (10,328,280 bytes)"),
        (1023 * 1024 + 1000, "1023.98 KiB (1,048,552 bytes)"),
        (3 << 40, "3 TiB (3,298,534,883,328 bytes)"),
    ],
)
def test_describe_bytes_is_readable_and_exact(value, text):
    from titan_plugins.settings import describe_bytes

    assert describe_bytes(value) == text
