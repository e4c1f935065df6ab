"""GlooWorkerPool: rank order, exceptions with worker tracebacks, tasks from test files, reuse,
timeouts and dead workers (the pool is rebuilt on next use)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from titan_plugins.testing.workers import (
    GlooWorkerPool,
    RemoteTraceback,
    WorkerPoolError,
    WorkerTimeout,
)

pytestmark = pytest.mark.multiprocess

GREETING = "hello from the test file"  # module global: proves the worker loaded this file
_CALLS = 0  # per-process counter: proves the same worker processes serve successive tasks


def rank_info(tag: str, scale: int = 1) -> tuple:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)  # a real collective across the pool's gloo world
    return dist.get_rank(), dist.get_world_size(), tag, scale * int(total.item())


def fail_on_rank_1(message: str) -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(message)
    return dist.get_rank()


def greeting_and_module() -> tuple:
    return GREETING, __name__


def count_calls() -> tuple:
    global _CALLS
    _CALLS += 1
    return os.getpid(), _CALLS


def worker_environment() -> dict:
    import sys

    import torch

    import titan_plugins
    from titan_plugins.hosts.megatron.testing import cpu_harness

    return {
        "plugins_activated": titan_plugins.active_manager() is not None,
        "autoload": os.environ.get("TITAN_PLUGINS_AUTOLOAD"),
        "compile_disabled": os.environ.get("TORCH_COMPILE_DISABLE"),
        "threads": torch.get_num_threads(),
        "harness": cpu_harness.installed(),
        "megatron_imported": "megatron.core" in sys.modules,
    }


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def exit_hard(code: int) -> None:
    os._exit(code)


def test_results_come_back_in_rank_order(gloo_pool2):
    results = gloo_pool2.run(rank_info, "x", scale=10)
    assert results == [(0, 2, "x", 30), (1, 2, "x", 30)]


def test_worker_exception_is_raised_with_its_traceback(gloo_pool2):
    with pytest.raises(ValueError, match="rank one disagrees") as info:
        gloo_pool2.run(fail_on_rank_1, "rank one disagrees")
    error = info.value
    assert error.worker_rank == 1
    assert isinstance(error.__cause__, RemoteTraceback)
    # The worker's own frames, not the parent's, are in the text.
    assert "fail_on_rank_1" in error.worker_traceback
    assert "raise ValueError(message)" in str(error.__cause__)
    # The pool is still usable after a task failure that left no rank hanging.
    assert [r[0] for r in gloo_pool2.run(rank_info, "after")] == [0, 1]


def test_functions_defined_in_a_test_file_run_in_workers(gloo_pool2):
    results = gloo_pool2.run(greeting_and_module)
    assert [greeting for greeting, _ in results] == [GREETING, GREETING]


def test_workers_are_reused_across_calls(gloo_pool2):
    first = gloo_pool2.run(count_calls)
    second = gloo_pool2.run(count_calls)
    assert [pid for pid, _ in first] == [pid for pid, _ in second]
    assert all(pid != os.getpid() for pid, _ in first)
    assert [n for _, n in second] == [n + 1 for _, n in first]


def test_workers_are_set_up_for_megatron_tests(gloo_pool2):
    expected = {
        "plugins_activated": False,  # installed plugins stay off until a test activates them
        "autoload": "0",
        "compile_disabled": "1",
        "threads": 1,
        "harness": True,
        "megatron_imported": True,
    }
    assert gloo_pool2.run(worker_environment) == [expected, expected]


def gloo_io_threads() -> int:
    comms = (Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir())
    return sum(comm == "gloo_tcp_loop" for comm in comms)


def groups_at_once(count: int) -> dict:
    """``count`` new groups of the two ranks, used at once: async all-reduces, then a send and a
    receive on every group in flight together."""
    import torch
    import torch.distributed as dist

    from titan_plugins.testing import gloo_device

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    threads_before = gloo_io_threads()
    groups = [dist.new_group([0, 1]) for _ in range(count)]
    tensors = [torch.full((50_000,), float(rank + i)) for i in range(count)]
    for work in [dist.all_reduce(t, group=g, async_op=True) for t, g in zip(tensors, groups)]:
        work.wait()
    received = [torch.zeros(1_000) for _ in range(count)]
    requests = []
    for i, group in enumerate(groups):
        requests.append(dist.isend(torch.full((1_000,), 10.0 * rank + i), peer, group=group))
        requests.append(dist.irecv(received[i], peer, group=group))
    for request in requests:
        request.wait()
    return {
        "shared": gloo_device.shared(),
        "threads_added": gloo_io_threads() - threads_before,
        "sums": [sorted(set(t.tolist())) for t in tensors],
        "received": [sorted(set(r.tolist())) for r in received],
    }


def test_a_workers_groups_share_one_io_thread_and_still_run_at_once(gloo_pool2):
    # each gloo group had a device whose I/O thread wakes every 10 ms: a worker keeping every
    # layout's groups ran 70-90 of them, idle, through the whole session (gloo_device)
    results = gloo_pool2.run(groups_at_once, 6)
    for rank, result in enumerate(results):
        assert result["shared"] and result["threads_added"] == 0
        assert result["sums"] == [[float(1 + 2 * i)] for i in range(6)]
        assert result["received"] == [[10.0 * (1 - rank) + i] for i in range(6)]


def test_closures_are_rejected_before_anything_runs(gloo_pool2):
    with pytest.raises(ValueError, match="module-level function"):
        gloo_pool2.run(lambda: 0)


def test_timeout_and_dead_worker_tear_down_and_rebuild_the_pool():
    pool = GlooWorkerPool(1)
    try:
        ((first_pid, _),) = pool.run(count_calls)
        with pytest.raises(WorkerTimeout, match="did not finish within"):
            pool.run(sleep_for, 60, timeout=1)
        ((second_pid, calls),) = pool.run(count_calls)
        assert second_pid != first_pid and calls == 1  # a fresh worker process
        with pytest.raises(WorkerPoolError, match="died"):
            pool.run(exit_hard, 3)
        assert not pool.started  # torn down; the next run() starts a fresh world (as above)
    finally:
        pool.close()


def path_and_port() -> tuple:
    import sys

    return sys.path[0], os.environ.get("MASTER_PORT"), rank_info("preloaded")


def test_preloaded_pools_are_set_up_alike_and_each_is_a_fresh_process():
    """Workers forked from the fork server (torch and megatron.core imported once) get the same
    set-up, their own pool's rendezvous, and no state from an earlier pool."""
    expected = {
        "plugins_activated": False, "autoload": "0", "compile_disabled": "1", "threads": 1,
        "harness": True, "megatron_imported": True,
    }  # fmt: skip
    with GlooWorkerPool(2, preloaded=True) as pool:
        assert pool.run(worker_environment) == [expected, expected]
        first = pool.run(count_calls)
        (_, port, info), _ = pool.run(path_and_port)
        assert info == (0, 2, "preloaded", 3)
    with GlooWorkerPool(2, preloaded=True) as pool:
        second = pool.run(count_calls)
        (_, other_port, _), _ = pool.run(path_and_port)
    assert [n for _, n in second] == [1, 1]  # nothing of the first pool's processes survived
    assert {pid for pid, _ in first}.isdisjoint(pid for pid, _ in second)
    assert port != other_port


def read_env(name: str) -> str | None:
    return os.environ.get(name)


def test_a_preloaded_pool_sees_the_environment_of_its_start_not_the_servers(monkeypatch):
    monkeypatch.setenv("TITAN_TEST_MARK", "before")
    with GlooWorkerPool(1, preloaded=True) as pool:
        assert pool.run(read_env, "TITAN_TEST_MARK") == ["before"]
    monkeypatch.setenv("TITAN_TEST_MARK", "after")  # the server started with "before" (or none)
    monkeypatch.setenv("TITAN_TEST_OTHER", "1")
    with GlooWorkerPool(1, preloaded=True) as pool:
        assert pool.run(read_env, "TITAN_TEST_MARK") == ["after"]
    monkeypatch.delenv("TITAN_TEST_OTHER")
    with GlooWorkerPool(1, preloaded=True) as pool:
        assert pool.run(read_env, "TITAN_TEST_OTHER") == [None]


def test_a_preloaded_pool_under_another_sys_path_is_spawned_with_it(monkeypatch, tmp_path):
    with GlooWorkerPool(1, preloaded=True) as pool:
        pool.run(count_calls)  # the fork server runs with this sys.path
    monkeypatch.syspath_prepend(str(tmp_path))  # as verify does for a Megatron-LM checkout
    with GlooWorkerPool(1, preloaded=True) as pool:
        ((first, _, _),) = pool.run(path_and_port)
    assert first == str(tmp_path)


def test_a_preloaded_pool_refuses_an_environment_of_its_own():
    with pytest.raises(ValueError, match="pass env only to a spawned pool"):
        GlooWorkerPool(1, env={"X": "1"}, preloaded=True)
