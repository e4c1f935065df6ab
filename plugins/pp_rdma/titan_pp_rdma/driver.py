"""How a transport makes progress: the waiting thread drives, a helper acts meanwhile.

A ``wait`` drives progress itself: it sleeps in ``select`` on the control sockets, so a record
wakes it at once, and polls a Mooncake transfer in flight only around its predicted end, with
short naps whose timer slack is lowered (the kernel's default 50 us slack turned a 10 us nap
into ~70 us). A wait for a receive first checks the sockets without sleeping, once, for up to
``TITAN_PP_RDMA_SPIN_US`` (``_spin``): on a VM a sleep and its wake-up cost more CPU than that
(an idle core halts), and a pipeline's next message often comes within it. Every post
(``isend`` / ``irecv``) runs a progress round too.

While the training thread computes with ops outstanding that need someone to act before it
waits (a read to start or poll, a read-done to answer, device work to watch: ``Link.needs_ticks``),
a helper thread acts for it, so reads start and read-done answers go out during compute. While a
read or device work needs polling it runs a round every ``TICK_S`` (sooner when a transfer is
due); while only a record can move its ops (a receive waiting for its announce, a send for its
read-done) it sleeps on the control sockets, so a read starts as soon as its announce arrives
(ticking instead took 110-130 rounds per benchmark step and rank when every message went by read).
It does nothing while a ``wait`` drives: it naps without the sockets, since a second thread woken
by the same record competes for the GIL and the core exactly when the message is on its critical
path (a record that arrives just after its owner began to wait still wakes both; the helper then
steps aside). Posts do not wake it either (waking it from every post that gave it work lowered the
ping-pong benchmark's ratio by 8-23%), except where it would sleep through their work: the first
post of a quiet spell (below), or one that needs polling while it listens (``_rouse``).
Otherwise - no ops, or only receives the peer sends inline, which complete in the owner's own wait
with nothing to overlap - it only looks every ``IDLE_TICK_S`` whether that changed and runs a round
every ``HOUSEKEEPING_S``: in the PP=2 x VPP=2 benchmark step (32 KiB messages, all inline) it ran
132-154 rounds per step on each rank, each taking the GIL from a computing training thread, and
now runs 8-12. Once no op has needed it for ``QUIET_S`` it stops looking and wakes only for the
housekeeping rounds: a wake-up is not free (a bare 5 ms ``select`` loop took ~150 us of CPU per
wake-up on the benchmarks' 2-core VM, so the glances alone took 3.6% of a core from the training
thread).
"""

from __future__ import annotations

import atexit
import ctypes
import select
import socket
import threading
import time
import weakref
from typing import Any

from titan_pp_rdma.errors import PPRdmaError

FIRST_NAP_S = 1e-5
MAX_NAP_S = 1e-4  # a waiting rank polls a transfer in flight at least this often
IDLE_S = 0.5  # longest sleep when only a socket can bring news
TICK_S = 1e-3  # the helper's round interval while ops need it
IDLE_TICK_S = 5e-3  # how often it looks whether they do, otherwise (no round: a glance)
HOUSEKEEPING_S = 5e-2  # and runs a round anyway (Mooncake's inbox, a peer that died)
QUIET_S = 0.5  # no op needed it for this long: it sleeps from one housekeeping round to the next
FINE_SLACK_NS = 1000
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_LIBC: Any = None


def timer_slack(ns: int | None) -> int | None:
    """Set this thread's timer slack (Linux ``prctl``); returns the previous value.

    The kernel lets a sleep overrun by the slack, 50 us by default: a 10 us poll nap became
    ~70 us. While a thread polls a transfer, 1 us makes naps what they say.
    """
    try:
        global _LIBC
        _LIBC = _LIBC or ctypes.CDLL(None)
        prctl = _LIBC.prctl
        previous = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
        if ns is not None and previous >= 0:
            prctl(29, ns, 0, 0, 0)  # PR_SET_TIMERSLACK
        return previous if previous >= 0 else None
    except (AttributeError, OSError):
        return None


class DriverMixin:
    """Helper thread, sleeping and waking (mixed into ``MooncakeTransport``)."""

    links: dict[int, Any]
    error: PPRdmaError | None
    _lock: Any

    def _round(self) -> float | None:  # implemented by the transport
        raise NotImplementedError

    def _start_driver(self, background: bool, rank: int) -> None:
        self._waiting = 0
        self._closed = False
        self._quiet = False  # (lock held to change it) the helper sleeps until housekeeping
        self._listening = False  # (lock held to change it) ... or until a record arrives
        self.helper_rounds = 0  # rounds the helper ran (benchmarks: each took the GIL)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._drive, name=f"pp_rdma-progress-{rank}", daemon=True
            )
            self._thread.start()
        _LIVE.add(self)

    def _open_channels(self) -> list[Any]:
        """The control channels a sleep or a spin watches (those whose peer has not closed)."""
        return [ln.channel for ln in self.links.values() if not ln.channel.eof]

    def _block(self, timeout: float, sockets: bool = True, pokes: bool = False) -> None:
        """Sleep at most ``timeout`` until a control socket needs us (``sockets``) or, for the
        helper (``pokes``), until a poke. The wake-up socket is the helper's alone: a wait that
        watched it too would drain a poke meant for a helper not yet asleep, which would then
        sleep through the work the poke announced."""
        channels = self._open_channels() if sockets else []
        readable = [self._wake_r, *channels] if pokes else channels
        writable = [c for c in channels if c.wants_write]
        try:
            ready = select.select(readable, writable, [], max(timeout, 0.0))[0]
        except (OSError, ValueError):  # a socket closed under us: the next round reports it
            time.sleep(min(timeout, 1e-3))
            return
        if not pokes or self._wake_r not in ready:  # (a failing recv costs a syscall)
            return
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _spin(self, seconds: float) -> bool:
        """Check the control sockets without sleeping for at most ``seconds``; True as soon as
        one has something to read. Where a sleep and its wake-up cost more CPU than the spin (a
        VM's idle core halts: ~50-150 us per wake-up on the benchmarks' 2-core VM), a record
        that comes within it is taken sooner and for less."""
        channels = self._open_channels()
        end = time.perf_counter() + seconds
        try:
            while time.perf_counter() < end:
                if select.select(channels, [], [], 0)[0]:
                    return True
        except (OSError, ValueError):  # a socket closed under us: the next round reports it
            return True
        return False

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def _needs_ticks(self) -> bool:
        return any(ln.needs_ticks() for ln in self.links.values())

    def _drive(self) -> None:
        """The helper thread: acts while the training thread computes (see the module doc)."""
        try:
            self._drive_rounds()
        except Exception as exc:  # a dead helper must not pass for a slow one
            self.error = self.error or PPRdmaError(f"pp_rdma: progress thread failed: {exc!r}")

    def _drive_rounds(self) -> None:
        timer_slack(FINE_SLACK_NS)
        last_round = last_needed = time.monotonic()
        while not self._closed:
            if self._waiting or self.error is not None:  # the training thread drives
                self._listening = False  # (only this thread sets it; it naps off the sockets)
                self._block(HOUSEKEEPING_S if self._quiet else TICK_S, sockets=False, pokes=True)
                continue
            due, busy = None, False
            with self._lock:
                if self._closed:
                    break
                now = time.monotonic()
                needed = self._needs_ticks()
                if needed:
                    last_needed = now
                if needed or now - last_round >= HOUSEKEEPING_S:
                    last_round = now
                    self.helper_rounds += 1
                    try:
                        due = self._round()
                    except PPRdmaError:
                        pass  # recorded in self.error; the training thread raises it
                    except Exception as exc:  # a bug must surface, not kill progress silently
                        self.error = PPRdmaError(f"pp_rdma: progress thread failed: {exc!r}")
                    busy = self.error is None and self._needs_ticks()
                    if busy:  # (e.g. a housekeeping round that started a read)
                        last_needed = time.monotonic()
                # Decided under the lock, so a post that needs the helper either finds it
                # awake or sees these and pokes it (``_rouse``).
                quiet = self._quiet = not busy and time.monotonic() - last_needed > QUIET_S
                # Only a record can move the ops (a receive waiting for its announce, a send
                # for its read-done): sleep on the sockets, so a read starts as soon as its
                # announce arrives. Ticking every 1 ms instead cost ~110-130 rounds per
                # benchmark step and rank when every message went by read (25-39 ms of CPU).
                listening = self._listening = busy and due is None
            # (the decisions as taken under the lock: a post may clear the flags meanwhile, and
            # its poke then ends this sleep at once)
            if listening:
                self._block(HOUSEKEEPING_S, pokes=True)
            elif due is not None:
                early = due - time.perf_counter()
                self._block(min(max(early, FIRST_NAP_S), TICK_S), sockets=False, pokes=True)
            else:
                self._block(HOUSEKEEPING_S if quiet else IDLE_TICK_S, sockets=False, pokes=True)

    def _rouse(self, due: float | None) -> None:
        """After a post's round or a wait (lock held; ``due``: when the last round wants a poll,
        None when only a record can move the ops): wake a helper sleeping on something the post
        does not trigger: a quiet one when an op now needs it, one listening for records when an
        op now needs polling (a read started, a device event).

        Only the first such post pokes (the helper is awake after it): a helper woken by every
        post competes for the GIL and the core just when the message is on its critical path.
        (A wait's rounds may take the records a listening helper sleeps on, e.g. the announce of
        another receive, and start its read: without this the read would wait for housekeeping.)
        """
        if (self._quiet and self._needs_ticks()) or (self._listening and due is not None):
            self._quiet = self._listening = False
            self._poke()

    def flush(self, timeout_s: float) -> bool:
        """Send every queued record (e.g. the job's last read-done); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
                return False
            try:
                pending = [ln.channel for ln in self.links.values() if not ln.channel.flush()]
            finally:
                self._lock.release()
            if not pending or all(c.eof for c in pending):
                return True
            select.select([], pending, [], 0.01)
        return False

    def _stop_driver(self) -> None:
        self._closed = True
        self._poke()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _close_wakeup(self) -> None:
        self._wake_r.close()
        self._wake_w.close()


@atexit.register
def _flush_at_exit() -> None:
    # The last "read done" of a job must still reach its sender, or the sender's final send
    # never completes: drain what is queued before the interpreter exits.
    for transport in list(_LIVE):
        if not transport._closed:
            transport.flush(5.0)
