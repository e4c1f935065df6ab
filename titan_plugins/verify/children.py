"""Every process ``titan-plugins verify`` started, found and stopped, so none outlives it.

verify starts the upstream tests' ranks (``subprocess``), the differential check's workers
(forked by the preloaded pools' fork server, or spawned), the fork server itself and
multiprocessing's resource tracker. The fork server and the tracker live until every process
holding their pipes is gone: a worker left behind (one forked after its parent stopped waiting,
still waiting for a rendezvous that never comes) kept both alive as orphans. So verify stops
them itself: :func:`stop_all` after a Ctrl-C, :func:`stop_helpers` at a normal end; what ran
before verify began (:func:`before`: an in-process caller's own pools) is left alone.

The fork server and the tracker are reached through multiprocessing's own singletons
(``multiprocessing.forkserver._forkserver``, ``multiprocessing.resource_tracker.
_resource_tracker``): CPython offers no public call that stops them (their ``_stop`` waits
without a bound, for tests), and ``titan_plugins.testing.workers``, which starts the server,
offers none either. Linux only where it matters: without ``/proc`` no descendant is found and
only the two helpers are stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker, util
from pathlib import Path

HELPER_EXIT_S = 5.0
"""How long the fork server or the tracker gets to end by itself once its pipe is closed."""
ROUNDS = 20
"""Rescans of the process tree while stopping (a process forked during a scan is found by the
next one; stopped processes fork no more)."""


def descendants(root: int | None = None) -> list[int]:
    """The pids of every living descendant of ``root`` (default: this process), parents first,
    read from ``/proc`` (none where it cannot be read). Zombies are left out: they are dead."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # ended while we looked
            continue
        # the command name may hold spaces and parentheses: the fields follow the last ")"
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state not in ("Z", "X"):
            children.setdefault(int(ppid), []).append(int(name))
    found: list[int] = []
    todo = [os.getpid() if root is None else root]
    while todo:
        for pid in children.get(todo.pop(0), []):
            found.append(pid)
            todo.append(pid)
    return found


def kill_descendants(spare: set[int] | None = None) -> list[int]:
    """Stop every descendant of this process at once: each is frozen first (``SIGSTOP``: a
    frozen fork server forks no new worker, a frozen worker starts nothing), the tree read again
    until it holds no process not yet frozen, then all are killed (``SIGKILL``). ``spare``:
    pids left running (the resource tracker, which ends by itself). Returns the pids killed."""
    spare = spare or set()
    frozen: list[int] = []
    for _ in range(ROUNDS):
        new = [pid for pid in descendants() if pid not in spare and pid not in frozen]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return frozen


def _reap(pid: int, wait_s: float) -> None:
    """Wait up to ``wait_s`` for this process's child ``pid`` to end, then kill it; reaped."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            return
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.05)


def stop_fork_server(wait_s: float = HELPER_EXIT_S) -> None:
    """End the fork server this process started, if any: its "alive" pipe closed (it ends
    once no worker holds the pipe either), killed after ``wait_s``; multiprocessing's record
    of it cleared, so a later pool starts a new one."""
    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(OSError, TypeError):
        os.close(server._forkserver_alive_fd)
    _reap(pid, wait_s)
    address = server._forkserver_address
    if address and not util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)
    server._forkserver_pid = None
    server._forkserver_alive_fd = None
    server._forkserver_address = None


def stop_resource_tracker(wait_s: float = HELPER_EXIT_S) -> None:
    """End multiprocessing's resource tracker, if this process started one: its pipe closed, it
    cleans up what is still registered and ends once no other process holds the pipe (the
    workers, the fork server); killed after ``wait_s``."""
    tracker = resource_tracker._resource_tracker
    fd, pid = tracker._fd, tracker._pid
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    tracker._fd = None
    tracker._pid = None
    if pid is not None:
        _reap(pid, wait_s)


@dataclass(frozen=True)
class Before:
    """What ran before verify started anything: never stopped by it (an in-process caller's own
    pools, fork server and tracker, e.g. a test session's)."""

    pids: frozenset[int]
    fork_server: int | None
    tracker: int | None


def before() -> Before:
    """What runs now (call it before verify starts anything)."""
    return Before(
        frozenset(descendants()),
        forkserver._forkserver._forkserver_pid,
        resource_tracker._resource_tracker._pid,
    )


def stop_all(was: Before) -> None:
    """After a Ctrl-C: kill at once every descendant verify started (the tracker aside), then
    reap the fork server and end the tracker, if verify started them."""
    tracker = resource_tracker._resource_tracker._pid
    kill_descendants(set(was.pids) | ({tracker} if tracker else set()))
    if was.fork_server is None:
        stop_fork_server(wait_s=0.0)
    if was.tracker is None:
        stop_resource_tracker()


def stop_helpers(was: Before) -> None:
    """At a normal end, once every pool is closed: end the fork server and the tracker verify
    started, then kill anything else it started that still runs (none, unless a worker hung)."""
    if was.fork_server is None:
        stop_fork_server()
    if was.tracker is None:
        stop_resource_tracker()
    kill_descendants(set(was.pids))
