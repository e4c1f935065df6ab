"""Run the map step (one trace -> one summary) on a local process pool or on Ray.

Local: ``multiprocessing`` with ``imap_unordered`` (one file per task, so a worker holds one
rank at a time) and a progress bar on stderr.  Ray (optional, ``pip install ray``): the same
function as Ray tasks, for clusters whose nodes see the traces on shared storage; chosen over
Dask because Megatron RL hosts (slime, miles) already run inside Ray clusters, so the engine is
usually there already.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .summarize import Options, summarize


class EngineError(Exception):
    """The chosen engine cannot run here; the message names the fix."""


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal, or when forced)."""

    def __init__(self, total: int, enabled: bool | None = None, label: str = "traces") -> None:
        self.total, self.done, self.label = total, 0, label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.monotonic()

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` finished items and redraw."""
        self.done += n
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        bar = "#" * int(30 * frac)
        rate = self.done / max(1e-9, time.monotonic() - self.t0)
        sys.stderr.write(
            f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {rate:.1f}/s"
            + ("\n" if self.done >= self.total else "")
        )
        sys.stderr.flush()


Task = tuple[str, str | None, int, Options]


def _task(args: Task) -> dict[str, Any]:
    return summarize(*args)


def _tasks(paths: list[str], timeline_dir: str | None, options: Options | None) -> list[Task]:
    return [(p, timeline_dir, i, options or Options()) for i, p in enumerate(paths)]


TASKS_PER_WORKER = 64  # a worker is replaced after this many files (bounds its heap's growth)


def start_method(files: int = 1, workers: int = 1) -> str:
    """How pool workers start: ``fork`` from a process running one thread (the ``titan-trace``
    command: workers inherit its imports, ~0.2 CPU-s less than a fork server's interpreter per
    run) when no worker will be replaced; else ``forkserver``: a library call from a training
    process (its native threads), and runs of more than TASKS_PER_WORKER files per worker, whose
    replacement workers the pool starts from its own thread while its other threads run (a fork
    then could copy a lock held mid-operation); ``spawn`` on macOS."""
    if sys.platform == "darwin":
        return "spawn"
    if files > TASKS_PER_WORKER * workers:
        return "forkserver"
    try:
        threads = len(os.listdir("/proc/self/task"))  # native threads too, not only Python's
    except OSError:
        threads = 0  # unknown: the safe choice
    return "fork" if threads == 1 else "forkserver"


def map_local(
    paths: list[str], timeline_dir: str | None, workers: int = 0, options: Options | None = None
) -> Iterator[dict]:
    """Summaries of ``paths`` from a local process pool (``workers`` <= 0: one per CPU)."""
    n = workers if workers > 0 else (os.cpu_count() or 1)
    n = max(1, min(n, len(paths)))
    tasks = _tasks(paths, timeline_dir, options)
    if n == 1:
        yield from map(_task, tasks)
        return
    ctx = mp.get_context(start_method(len(paths), n))
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload([__name__])  # workers fork with the parser imported
    with ctx.Pool(n, maxtasksperchild=TASKS_PER_WORKER) as pool:
        yield from pool.imap_unordered(_task, tasks, chunksize=1)


def map_ray(
    paths: list[str],
    timeline_dir: str | None,
    address: str | None = None,
    options: Options | None = None,
) -> Iterator[dict]:
    """Summaries of ``paths`` computed as Ray tasks (every node must see the same paths)."""
    try:
        import ray
    except ImportError:
        raise EngineError(
            "--engine ray needs Ray: pip install 'ray>=2.9' (or use the default local engine)"
        ) from None
    started = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        remote = ray.remote(_task)
        pending = [remote.remote(t) for t in _tasks(paths, timeline_dir, options)]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield from ray.get(done)
    finally:
        if started:
            ray.shutdown()


def run_map(
    paths: list[str],
    timeline_dir: str | None,
    engine: str = "local",
    workers: int = 0,
    progress: bool | None = None,
    ray_address: str | None = None,
    on_result: Callable[[dict], None] | None = None,
    options: Options | None = None,
) -> list[dict[str, Any]]:
    """Summarise every path with the chosen engine; returns the summaries in input order."""
    if engine == "local":
        it: Iterable[dict] = map_local(paths, timeline_dir, workers, options)
    elif engine == "ray":
        it = map_ray(paths, timeline_dir, ray_address, options)
    else:
        raise EngineError(f"unknown engine {engine!r}: use 'local' or 'ray'")
    bar = Progress(len(paths), progress)
    out = {}
    for res in it:
        out[res["index"]] = res
        if on_result:
            on_result(res)
        bar.update()
    return [out[i] for i in range(len(paths))]
