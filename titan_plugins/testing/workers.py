"""Long-lived gloo worker processes that run test tasks on every rank of a small world.

Importing megatron.core costs ~7 s, so tests share workers instead of spawning per test. Each
worker: ``TITAN_PLUGINS_AUTOLOAD=0`` (installed plugins do not activate by themselves; tests
activate them explicitly with ``plugin_active``), ``TORCH_COMPILE_DISABLE=1``, one thread,
``cpu_harness.install()``, ``import megatron.core``, ``init_process_group("gloo")`` on 127.0.0.1.

Tasks are module-level functions (any file; test files are loaded by path in the worker) that
start with ``tiny_gpt.init_parallel(...)``: workers keep process state between tasks, and that call
resets megatron's model-parallel state and RNG. Arguments and results travel by pickle: return
plain data (numbers, lists, dicts, tensors), not objects of classes defined in test files.
Workers are spawned, so a script (not pytest) that uses a pool needs the usual
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.connection import wait
from typing import Any

from titan_plugins.testing import line_guard
from titan_plugins.testing._worker_process import FunctionRef, worker_main
from titan_plugins.testing.activation import environ

__all__ = ["GlooWorkerPool", "RemoteTraceback", "WorkerError", "WorkerPoolError", "WorkerTimeout"]

WORKER_ENV = {
    "TITAN_PLUGINS_AUTOLOAD": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# After one rank fails, how long the others get to report before the pool is presumed hung (a
# failed rank usually leaves its peers blocked in a collective).
ERROR_GRACE_S = 10.0
_ENV_LOCK = threading.Lock()  # os.environ is process-global: serialise spawns that edit it
_FORK_SERVER_PATH: list[str] | None = None  # the sys.path the fork server started with


class WorkerPoolError(RuntimeError):
    """The pool could not run a task (start-up failed, a worker died, a task timed out)."""


class WorkerTimeout(WorkerPoolError):
    """A task did not finish in time; the pool was torn down and restarts on next use."""


class WorkerError(RuntimeError):
    """A task raised an exception that could not be sent back as itself (see ``__cause__``)."""


class RemoteTraceback(Exception):
    """Carries a worker's traceback text; set as ``__cause__`` of a re-raised task exception."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _function_ref(fn: Callable[..., Any]) -> FunctionRef:
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"GlooWorkerPool.run needs a module-level function, got {fn!r}: define it at the top "
            "level of a module or test file (closures and lambdas cannot be sent to workers)."
        )
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:  # builtins
        path = None
    return module, qualname, os.path.abspath(path) if path else None


def _raise_task_error(rank: int, exc_bytes: bytes | None, tb_text: str, summary: str) -> None:
    exc: BaseException | None = None
    if exc_bytes is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(exc_bytes)
    if not isinstance(exc, BaseException):
        exc = WorkerError(summary)
    exc.worker_rank = rank  # type: ignore[attr-defined]
    exc.worker_traceback = tb_text  # type: ignore[attr-defined]
    exc.add_note(f"(raised in gloo worker rank {rank}; worker traceback in the cause above)")
    raise exc from RemoteTraceback(f"\n\nworker rank {rank} traceback:\n{tb_text}")


def _fork_server() -> Any:
    """The ``forkserver`` context whose server has imported torch and megatron.core with the
    workers' environment (``_worker_preload``), or None when this process cannot use it: the
    server is one per process and keeps the ``sys.path`` it started with, so a later pool under
    another ``sys.path`` (another Megatron-LM checkout first) is spawned instead."""
    global _FORK_SERVER_PATH
    if _FORK_SERVER_PATH is not None and _FORK_SERVER_PATH != sys.path:
        return None
    ctx = multiprocessing.get_context("forkserver")
    if _FORK_SERVER_PATH is None:
        if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
            return None  # another server, started by other code without our preload

        ctx.set_forkserver_preload(["titan_plugins.testing._worker_preload"])
        with _ENV_LOCK, environ(WORKER_ENV):  # the server's environment, once
            forkserver.ensure_running()
        _FORK_SERVER_PATH = list(sys.path)
    return ctx


class GlooWorkerPool:
    """``world_size`` spawned processes forming one gloo world, reused across tasks.

    ``env`` adds or overrides worker environment variables (over ``WORKER_ENV``). Workers start on
    ``start()`` (non-blocking) or on the first ``run()``. After a timeout, a dead worker or a hung
    failure the pool is torn down and rebuilt on the next ``run()``. Use ``close()`` (or ``with``).

    ``preloaded=True``: the workers are forked from a fork server that imported torch and
    megatron.core once, so a pool starts in about a second rather than ~7 s of imports per
    worker; each worker is still a fresh process (what one pool's tasks patch dies with it). For
    pools started one after another, such as one job per run. Such a worker gets the parent's
    environment as it is at the pool's start, but what torch and megatron read while importing
    they read in the server, and its output goes where the server's went (a failing task's
    traceback still comes back with the error).
    """

    def __init__(
        self,
        world_size: int,
        env: dict[str, str] | None = None,
        start_timeout: float = 300.0,
        preloaded: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if preloaded and env:
            raise ValueError(
                "a preloaded pool's workers import torch in the fork server, with the workers' "
                "default environment: pass env only to a spawned pool"
            )
        self.world_size = world_size
        self.preloaded = preloaded
        self.env = {**WORKER_ENV, **(env or {})}
        self.start_timeout = start_timeout
        self._lock = threading.RLock()
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._ready = False

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether worker processes exist (spawned and not torn down or closed)."""
        return bool(self._procs)

    def start(self) -> None:
        """Spawn the workers if they are not running (returns at once; ``run`` awaits readiness)."""
        with self._lock:
            if self._procs:
                return
            import torch.distributed as dist

            # The parent hosts the rendezvous store on a free port: no port race between workers.
            self._store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False,
                timeout=timedelta(seconds=self.start_timeout),
            )  # fmt: skip
            port = self._store.port
            ctx = (self.preloaded and _fork_server()) or multiprocessing.get_context("spawn")
            env = {**self.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            with _ENV_LOCK, environ(env):
                for rank in range(self.world_size):
                    parent_conn, child_conn = ctx.Pipe()
                    proc = ctx.Process(
                        target=worker_main,
                        # the whole environment: a forked worker would otherwise keep the
                        # server's, from when it started
                        args=(
                            rank,
                            self.world_size,
                            port,
                            child_conn,
                            self.start_timeout,
                            dict(os.environ),
                        ),
                        name=f"titan-gloo-worker-{rank}",
                        daemon=True,
                    )
                    proc.start()
                    child_conn.close()
                    self._procs.append(proc)
                    self._conns.append(parent_conn)
            self._ready = False

    def _await_ready(self) -> None:
        if self._ready:
            return
        replies = self._collect(self.start_timeout, "start-up")
        for rank, reply in enumerate(replies):
            if reply[0] == "error":
                self._teardown()
                raise WorkerPoolError(
                    f"gloo worker rank {rank} failed to start: {reply[3]}\n{reply[2]}"
                )
        self._ready = True

    def close(self) -> None:
        """Stop the workers (idempotent); the pool restarts if ``run`` is called again."""
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(("close",)))
            deadline = time.monotonic() + 10.0
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            self._teardown()

    def _teardown(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store, self._ready = [], [], None, False

    def __enter__(self) -> GlooWorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- tasks -------------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any
    ) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        An exception in a task is re-raised here as itself (``__cause__`` carries the worker
        traceback; ``worker_rank`` / ``worker_traceback`` attributes are set), or as
        ``WorkerError`` if it cannot be unpickled. ``timeout`` (seconds, excluding start-up) is
        reserved: ``fn`` cannot take a keyword argument named ``timeout``.
        """
        ref = _function_ref(fn)
        request = pickle.dumps(("run", ref, args, kwargs))  # fails here, before any rank starts
        # every worker imports megatron.core: a line_independent test must not get here
        line_guard.note_megatron_use(f"a gloo worker task ({ref[1]})")
        with self._lock:
            if not all(proc.is_alive() for proc in self._procs):
                self._teardown()  # a worker died while idle: rebuild the whole world
            self.start()
            self._await_ready()
            try:
                for conn in self._conns:
                    conn.send_bytes(request)
                replies = self._collect(timeout, f"task {ref[1]} from {ref[2] or ref[0]}")
            except BaseException:
                # Interrupted (Ctrl-C) or a broken pipe: workers may still be busy with this task
                # and would answer the next one with its replies. Start afresh next time.
                self._teardown()
                raise
        failed = [rank for rank, reply in enumerate(replies) if reply[0] == "error"]
        if failed:
            _, exc_bytes, tb_text, summary = replies[failed[0]]
            _raise_task_error(failed[0], exc_bytes, tb_text, summary)
        return [reply[1] for reply in replies]

    def _collect(self, timeout: float, what: str) -> list:
        """Wait for one reply per rank. Tears the pool down (and raises) on timeout or death."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            pending = [rank for rank in range(self.world_size) if rank not in replies]
            remaining = deadline - time.monotonic()
            handles = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = wait(handles, timeout=remaining) if remaining > 0 else []
            if not ready:
                return self._give_up(replies, pending, timeout, what)
            for rank in pending:
                if self._conns[rank].poll():
                    replies[rank] = self._receive(rank, what)
                    if replies[rank][0] == "error":
                        deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                elif self._procs[rank].sentinel in ready:
                    self._procs[rank].join(1.0)  # reap it so exitcode is known
                    code = self._procs[rank].exitcode
                    self._teardown()
                    raise WorkerPoolError(
                        f"gloo worker rank {rank} died (exit code {code}) during {what}; the pool "
                        "was torn down and restarts on next use."
                    )
        return [replies[rank] for rank in range(self.world_size)]

    def _receive(self, rank: int, what: str) -> tuple:
        try:
            data = self._conns[rank].recv_bytes()
        except (EOFError, OSError):
            self._procs[rank].join(1.0)
            code = self._procs[rank].exitcode
            self._teardown()
            raise WorkerPoolError(
                f"gloo worker rank {rank} died (exit code {code}) during {what}; the pool was "
                "torn down and restarts on next use."
            ) from None
        try:
            return pickle.loads(data)
        except Exception as exc:  # e.g. an instance of a class only the worker can import
            return ("error", None, "", f"the parent cannot unpickle the result: {exc!r}")

    def _give_up(self, replies: dict, pending: list[int], timeout: float, what: str) -> list:
        self._teardown()
        errors = {rank: reply for rank, reply in replies.items() if reply[0] == "error"}
        if errors:  # peers of a failed rank hung in a collective: report the real failure
            for rank in pending:
                replies[rank] = (
                    "error",
                    None,
                    "",
                    f"did not finish after rank {min(errors)} failed",
                )
            return [replies[rank] for rank in range(self.world_size)]
        raise WorkerTimeout(
            f"{what} did not finish within {timeout:.0f} s on gloo worker rank(s) {pending}; the "
            "pool was torn down and restarts on next use (raise timeout= if the task is slow)."
        )
