"""The plugins' shared host-memory ledger: one limit over act_offload's pool and rewind's
snapshots (and any later plugin that parks data in host RAM)."""

from __future__ import annotations

import gc

import pytest

from titan_plugins import host_memory


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
    store.planned = 16 << 10  # two snapshots need 32K: only 16K are left
    assert not store._fits([], None)
    assert "TITAN_PLUGINS_MAX_HOST_BYTES" in store.no_snapshot
    assert "'act_offload': 49152" in store.no_snapshot  # it says who holds what
    for buffer in held:
        pool.release(buffer)
    pool.clear()  # act_offload gives its idle buffers back: rewind now fits
    store.no_snapshot = ""
    assert store._fits([], None) and store.ledger.held == 32 << 10
    assert pool.acquire(48 << 10) is None  # and now the pool is the one refused
    assert pool.stats()["shared_refusals"] == 1
