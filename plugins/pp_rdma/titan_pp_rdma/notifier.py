"""Notifications sent from a helper thread, batched per peer.

A Mooncake notification is a synchronous RPC (~0.15 ms on loopback TCP). Sent inline, each one
would stall the training thread between posting a transfer and returning to compute; sent from
one FIFO thread (Mooncake releases the GIL), they overlap compute, keep their order, and
everything queued for a peer while the previous RPC ran goes out as one message.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from typing import Any

from titan_pp_rdma.errors import PPRdmaError
from titan_pp_rdma.mooncake_engine import PeerAddress

SEPARATOR = "\x1e"  # ASCII record separator: never in our fields or error texts


class Notifier:
    """FIFO of ``(peer, name, msg)`` drained by one daemon thread per process."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._queue: queue.SimpleQueue[tuple[PeerAddress, str, str]] = queue.SimpleQueue()
        # First failure per peer segment (e.g. the peer died): its sessions raise it.
        self.errors: dict[str, PPRdmaError] = {}
        self._pending = 0  # queued or being sent
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pp_rdma-notify", daemon=True)
        self._thread.start()
        # The last "read done" of a job must still reach its sender, or the sender's final
        # send never completes: drain the queue before the interpreter exits.
        atexit.register(self.flush, 5.0)

    def post(self, peer: PeerAddress, name: str, msg: str) -> None:
        """Queue a notification (returns at once)."""
        with self._lock:
            self._pending += 1
        self._queue.put((peer, name, msg))

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far was sent (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(1e-3)
        return not self._pending

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            grouped: dict[tuple[PeerAddress, str], list[str]] = {}
            for peer, name, msg in batch:
                grouped.setdefault((peer, name), []).append(msg)
            for (peer, name), msgs in grouped.items():
                try:
                    self._engine.notify(peer, name, SEPARATOR.join(msgs))
                except PPRdmaError as exc:
                    self.errors.setdefault(peer.session_id, exc)
            with self._lock:
                self._pending -= len(batch)
