"""A thin, typed wrapper around one Mooncake ``TransferEngine`` per process.

Mooncake's Python calls return status codes and never raise; this wrapper turns them into
:class:`PPRdmaError` with the peer named. Notifications (``TransferNotify``) only ride on the
synchronous calls, so a pure notification is a zero-length ``transfer_sync`` into the peer's
mailbox: the payload itself goes out with the non-blocking ``transfer_submit_write``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from titan_pp_rdma.errors import PPRdmaError
from titan_pp_rdma.settings import PPRdmaSettings

P2PHANDSHAKE = "P2PHANDSHAKE"
_MAILBOX_BYTES = 64


def rdma_nics() -> list[str]:
    """RDMA devices visible to this host (``/sys/class/infiniband``), empty when none."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def resolve_protocol(requested: str) -> str:
    """``rdma`` / ``tcp`` as requested; ``auto`` picks rdma when an RDMA NIC is visible."""
    if requested in ("rdma", "tcp"):
        return requested
    return "rdma" if rdma_nics() else "tcp"


def resolve_host(requested: str) -> str:
    """The address peers use to reach this rank.

    Explicit ``TITAN_PP_RDMA_HOST`` wins; a job whose MASTER_ADDR is loopback (or unset) stays on
    127.0.0.1; otherwise the local address of the interface that routes to MASTER_ADDR.
    """
    if requested:
        return requested
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost", "::1", ""):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PeerAddress:
    """What a rank publishes at handshake: its segment name and its mailbox address."""

    session_id: str
    mailbox: int


class MooncakeEngine:
    """One initialised TransferEngine with a registered mailbox (the target of notifications)."""

    def __init__(self, settings: PPRdmaSettings) -> None:
        from mooncake.engine import TransferEngine, TransferNotify

        self._notify_cls = TransferNotify
        self._write = TransferEngine.TransferOpcode.Write
        self.protocol = resolve_protocol(settings.protocol)
        self.host = resolve_host(settings.host)
        # Mooncake's own per-transfer timeout (seconds, its minimum is 5): align it with ours so
        # a dead peer fails a write instead of retrying for Mooncake's default 30 s.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(settings.timeout_s))))
        if self.host.startswith("127."):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.host)
        self.metadata = settings.metadata
        if self.metadata == P2PHANDSHAKE:
            local_name = self.host  # the engine picks its RPC port; the segment is host:port
        else:
            local_name = f"{self.host}:{_free_port(self.host)}"
        self._te: Any = TransferEngine()
        rc = self._te.initialize(local_name, self.metadata, self.protocol, settings.device)
        if rc != 0:
            raise PPRdmaError(
                f"pp_rdma: Mooncake initialize({local_name!r}, {self.metadata!r}, "
                f"{self.protocol!r}, {settings.device!r}) returned {rc}; check "
                "TITAN_PP_RDMA_METADATA / _PROTOCOL / _DEVICE, or set TITAN_PP_RDMA_BACKEND=torch"
            )
        if self.metadata == P2PHANDSHAKE:
            self.session_id = f"{self.host}:{self._te.get_rpc_port()}"
        else:
            self.session_id = local_name
        self._registered: dict[int, int] = {}
        self._mailbox = self.register(torch.zeros(_MAILBOX_BYTES, dtype=torch.uint8))
        # Notifications of every session of this process arrive here; each session takes its own.
        self._inbox: dict[str, list[tuple[str, str]]] = {}
        self._closed_tags: set[str] = set()
        self._notifier: Any = None

    @property
    def notifier(self) -> Any:
        """The process-wide notification thread (started on first use)."""
        if self._notifier is None:
            from titan_pp_rdma.notifier import Notifier

            self._notifier = Notifier(self)
        return self._notifier

    @property
    def address(self) -> PeerAddress:
        """This engine's handshake record."""
        return PeerAddress(self.session_id, self._mailbox.data_ptr())

    def register(self, buf: torch.Tensor) -> torch.Tensor:
        """Register a contiguous tensor's memory for remote writes; returns it (keep it alive)."""
        addr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        location = f"cuda:{buf.device.index or 0}" if buf.is_cuda else "*"
        rc = self._te.register_memory(addr, nbytes, location)
        if rc != 0:
            raise PPRdmaError(f"pp_rdma: Mooncake register_memory({nbytes} B) returned {rc}")
        self._registered[addr] = nbytes
        return buf

    def unregister(self, buf: torch.Tensor) -> None:
        """Undo :meth:`register` (the memory may be freed afterwards)."""
        if self._registered.pop(buf.data_ptr(), None) is not None:
            self._te.unregister_memory(buf.data_ptr())

    def submit_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> int:
        """Start a one-sided read of the peer's bytes; returns the id to poll with :meth:`status`.

        A read is used rather than a write because its completion is final at the initiator:
        over TCP, Mooncake reports a *write* complete once the bytes are in the local socket,
        before the peer has stored them, so a notification after it could overtake the data.
        """
        bid = self._te.batch_transfer_async_read(peer, [local_addr], [remote_addr], [nbytes])
        if bid <= 0 or bid >= 2**63:
            raise PPRdmaError(
                f"pp_rdma: Mooncake could not start a read from {peer} (id {bid}): the peer "
                "died or its address is unreachable"
            )
        return bid

    def status(self, bid: int) -> int:
        """1 done, 0 pending, negative failed or timed out (the id is freed when not pending)."""
        return self._te.transfer_check_status(bid)

    def notify(self, peer: PeerAddress, name: str, msg: str) -> None:
        """Deliver ``(name, msg)`` to the peer's ``get_notifies`` (a zero-length write)."""
        rc = self._te.transfer_sync(
            peer.session_id,
            self._mailbox.data_ptr(),
            peer.mailbox,
            0,
            self._write,
            self._notify_cls(name, msg),
        )
        if rc != 0:
            raise PPRdmaError(
                f"pp_rdma: could not reach pipeline peer {peer.session_id} (Mooncake rc {rc}): "
                "the peer process died or its address is unreachable"
            )

    def poll(self, tag: str) -> list[tuple[str, str]]:
        """``(sender, msg)`` notifications for session ``tag``, oldest first.

        Names are ``"<tag>/<sender rank>"``; notifications of other live sessions are kept for
        them, those of closed sessions dropped.
        """
        for n in self._te.get_notifies():
            their_tag, _, sender = n.name.rpartition("/")
            if their_tag not in self._closed_tags:
                self._inbox.setdefault(their_tag, []).append((sender, n.msg))
        return self._inbox.pop(tag, [])

    def close_tag(self, tag: str) -> None:
        """Drop a closed session's pending and future notifications."""
        self._closed_tags.add(tag)
        self._inbox.pop(tag, None)

    def close(self) -> None:
        """Unregister every buffer (the engine itself lives until the process exits)."""
        for addr in list(self._registered):
            self._te.unregister_memory(addr)
        self._registered.clear()
