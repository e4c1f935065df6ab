"""Ctrl-C during ``titan-plugins verify``: this process stops every process it started and says
so in one line; no child prints a ``KeyboardInterrupt`` traceback of its own.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: verify, its workers, the
fork server and the upstream tests' ranks. Each child used to die on its own, printing its
traceback (or, forked late, outlive verify waiting for a rendezvous). So the children never see
it: they are started inside :func:`shielded`, where SIGINT is *blocked* in this thread, and a
child keeps the signal mask it was started with (across ``fork`` and ``exec``; Python does not
unblock it at start-up, and the fork server's workers inherit the server's). Blocked, not
ignored: a Ctrl-C during the block reaches this process when the block ends, it is never lost.
This process alone handles it (:func:`handled`): stop the children (``SIGKILL``, after
freezing them, :mod:`~titan_plugins.verify.children`), then unwind as ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

STATUS = 130
"""The exit status of an interrupted verify: 128 + SIGINT, as a shell reports a Ctrl-C."""
MESSAGE = "titan-plugins verify: interrupted; every worker stopped, nothing written"


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """SIGINT blocked in this thread for the block: the processes and threads started in it
    keep it blocked for good (a Ctrl-C reaches this process only); this process gets a Ctrl-C
    that came meanwhile when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # no signal masks here: nothing to shield with
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass
class State:
    """Whether a Ctrl-C came (set by the handler, read by the caller's ``except``)."""

    interrupted: bool = False


@contextlib.contextmanager
def handled(stop: Callable[[], None]) -> Iterator[State]:
    """While the block runs, a Ctrl-C calls ``stop`` (which must end every child) and then
    raises ``KeyboardInterrupt`` where this process was; further Ctrl-Cs are ignored until the
    block ends (stopping is bounded: a second one would only leave a traceback mid-cleanup).
    Outside the main thread (signals go to it only) the block runs unguarded."""
    state = State()
    if not _main_thread():
        yield state
        return

    def on_sigint(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        state.interrupted = True
        stop()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)
