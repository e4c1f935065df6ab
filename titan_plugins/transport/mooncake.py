"""A thin, typed wrapper around one Mooncake ``TransferEngine`` (the core's, shared by every
plugin that moves bytes over Mooncake: pp_rdma's pipeline transfers, weight_sync's weight writes).

Mooncake's Python calls return status codes and never raise; this wrapper turns them into the
caller's error class with the peer named, and keeps the engine's listeners on the job's address
(:mod:`~titan_plugins.transport.bind_guard`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from titan_plugins.transport.addresses import rdma_nics as rdma_nics  # re-exported: callers
from titan_plugins.transport.bind_guard import (
    BindGuardError,
    confined_binds,
    is_wildcard,
    listening_sockets,
)

P2PHANDSHAKE = "P2PHANDSHAKE"
TCP_CHUNK_BYTES = 64 << 10
# Reads of at least twice this size are split into slices (at most MAX_SLICES). A 16 MiB read
# as 4 slices of 4 MiB beat one transfer in four paired comparisons on the 2-core test VM
# (gloo/this +0.03 to +0.31); a 4 MiB read as 4 of 1 MiB did not (-0.03, -0.07).
SLICE_BYTES = 4 << 20
MAX_SLICES = 4
# How often a write checks its transfers. Mooncake's own synchronous write spins a core until
# the bytes land; on the 2-core test VM that core is one the TCP transport needed: 1 GiB into
# another process took 0.43-0.53 s that way and 0.28-0.33 s submitted and checked every 0.5 ms.
WRITE_POLL_S = 0.0005


def resolve_protocol(requested: str) -> str:
    """``rdma`` / ``tcp`` as requested; ``auto`` picks rdma when an RDMA NIC is visible."""
    if requested in ("rdma", "tcp"):
        return requested
    return "rdma" if rdma_nics() else "tcp"


def resolve_host(requested: str) -> str:
    """The address peers use to reach this rank.

    An explicit host (the plugin's ``..._HOST`` knob) wins; a job whose MASTER_ADDR is loopback (or unset) stays on
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TransportError(RuntimeError):
    """A Mooncake call failed (the message names the call, the peer and the fix)."""


class MooncakeConfig(Protocol):
    """What an engine is built from (a plugin's settings object has these fields)."""

    protocol: str  # rdma | tcp | auto
    metadata: str  # P2PHANDSHAKE or a metadata server URL
    device: str  # RDMA device names, "" for all / none
    host: str  # this process's address on the job's network ("" = derive it)
    timeout_s: float


class MooncakeEngine:
    """One initialised TransferEngine, its listeners confined to the job's address.

    :param settings: the protocol, metadata, device, host and timeout to use.
    :param who: the plugin using it (prefixes every message).
    :param error: the exception class raised (a plugin's own, so its callers catch one type).
    :param hint: the plugin's way out, appended to an initialisation failure.
    """

    def __init__(
        self,
        settings: MooncakeConfig,
        who: str = "titan_plugins",
        error: type[Exception] = TransportError,
        hint: str = "",
    ) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:  # the plugin's own error: its caller falls back on it
            raise error(
                f"{who}: Mooncake Transfer Engine is not installed here ({err}): pip install "
                "mooncake-transfer-engine (mooncake-transfer-engine-non-cuda where there is no "
                f"CUDA){hint}"
            ) from None

        self.who, self._error = who, error

        self.protocol = resolve_protocol(settings.protocol)
        self.host = resolve_host(settings.host)
        # Mooncake's own per-transfer timeout (seconds, its minimum is 5): align it with ours so
        # a dead peer fails a read instead of retrying for Mooncake's default 30 s.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(settings.timeout_s))))
        # The TCP transport moves data in chunks of this size (default 64 KiB, one socket call
        # and one asio completion each); larger chunks cost less per byte.
        os.environ.setdefault("MC_TCP_SLICE_SIZE", str(TCP_CHUNK_BYTES))
        # With a metadata server, Mooncake advertises this address for its RPC port (else the
        # host's first interface); it must be the one bind_guard binds to.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.host)
        self.metadata = settings.metadata
        if self.metadata == P2PHANDSHAKE:
            local_name = self.host  # the engine picks its RPC port; the segment is host:port
        else:
            local_name = f"{self.host}:{free_port(self.host)}"
        self._te: Any = TransferEngine()
        before = set(listening_sockets())
        try:
            with confined_binds(self.host):
                rc = self._te.initialize(local_name, self.metadata, self.protocol, settings.device)
        except BindGuardError as err:  # the caller's one error type, with its way out
            raise error(f"{who}: {err}{hint}") from None
        if rc != 0:
            raise error(
                f"{who}: Mooncake initialize({local_name!r}, {self.metadata!r}, "
                f"{self.protocol!r}, {settings.device!r}) returned {rc}{hint}"
            )
        opened = {i: a for i, a in listening_sockets().items() if i not in before}
        wide = sorted(a for a in opened.values() if is_wildcard(a))
        if wide and not is_wildcard(f"{self.host}:0"):
            raise error(
                f"{who}: Mooncake listens on {', '.join(wide)} although the job uses "
                f"{self.host}; refusing to expose it on every interface"
            )
        self.listeners = sorted(opened.values())
        if self.metadata == P2PHANDSHAKE:
            self.session_id = f"{self.host}:{self._te.get_rpc_port()}"
        else:
            self.session_id = local_name
        self._registered: dict[int, int] = {}

    def register(self, buf: torch.Tensor) -> torch.Tensor:
        """Register a contiguous tensor's memory for remote access; returns it (keep it alive)."""
        addr, nbytes = buf.data_ptr(), buf.nbytes
        location = f"cuda:{buf.device.index or 0}" if buf.is_cuda else "*"
        rc = self._te.register_memory(addr, nbytes, location)
        if rc != 0:
            raise self._error(f"{self.who}: Mooncake register_memory({nbytes} B) returned {rc}")
        self._registered[addr] = nbytes
        return buf

    def unregister(self, buf: torch.Tensor) -> None:
        """Undo :meth:`register` (the memory may be freed afterwards)."""
        if self._registered.pop(buf.data_ptr(), None) is not None:
            self._te.unregister_memory(buf.data_ptr())

    def registered_regions(self) -> int:
        """How many regions are registered now (what a closed session must have given back)."""
        return len(self._registered)

    def write(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        """One-sided writes of local registered bytes into ``peer``'s registered memory; returns
        when every byte has landed (and no transfer reads the local bytes any more).

        Ranges adjacent on both sides go as one transfer; each transfer is submitted at once and
        checked every :data:`WRITE_POLL_S` (a batch of one: ``transfer_check_status`` looks at
        a batch's first task only).

        :raises: this engine's error class, naming the peer, when any write fails (the peer died,
            or the remote range is not registered there).
        """
        pending: list[int] = []
        failed = ""
        for at, to, nbytes in coalesced(zip(local, remote, lengths)):
            bid = self._te.batch_transfer_async_write(peer, [at], [to], [nbytes])
            if not _started(bid):
                failed = f"could not start (id {bid})"
                break
            pending.append(bid)
        # with a failure, still wait for what was started: the caller reuses the local bytes
        while pending:
            for bid in list(pending):
                state = self._te.transfer_check_status(bid)
                if state != 0:
                    pending.remove(bid)  # done (freed by Mooncake) or failed: never ask again
                if state < 0 and not failed:
                    failed = f"failed ({state})"
            if pending:
                time.sleep(WRITE_POLL_S)
        if failed:
            raise self._error(
                f"{self.who}: Mooncake write of {sum(lengths)} B to {peer} {failed}: the peer "
                "died, or its memory is no longer registered"
            )

    def submit_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> list[int]:
        """Start a one-sided read of the peer's bytes; returns the ids to poll with :meth:`status`.

        Large reads go out as several slices, each its own transfer: Mooncake's TCP transport
        runs them on separate connection lanes, in parallel. (Each slice is a batch of one:
        ``transfer_check_status`` looks at a batch's first task only, and the multi-task status
        call spins a core until everything is done.)
        """
        n = max(1, min(MAX_SLICES, nbytes // SLICE_BYTES))
        step = -(-nbytes // n)
        ids = []
        for offset in range(0, nbytes, step):
            length = min(step, nbytes - offset)
            bid = self._te.batch_transfer_async_read(
                peer, [local_addr + offset], [remote_addr + offset], [length]
            )
            if not _started(bid):
                raise self._error(
                    f"{self.who}: Mooncake could not start a read from {peer} (id {bid}): the peer "
                    "died or its address is unreachable"
                )
            ids.append(bid)
        return ids

    def status(self, ids: list[int]) -> int:
        """1 all done, 0 some pending, negative one failed; done ids are removed from ``ids``."""
        for bid in list(ids):
            state = self._te.transfer_check_status(bid)
            if state == 1:
                ids.remove(bid)  # freed by Mooncake: never ask about it again
            elif state < 0:
                return state
        return 0 if ids else 1

    def drain_notifies(self) -> list[tuple[str, str]]:
        """Mooncake notifications that arrived (the core's users send none: they are someone else's)."""
        return [(str(n.name), str(n.msg)) for n in self._te.get_notifies()]

    def close(self) -> None:
        """Unregister every buffer (the engine itself lives until the process exits)."""
        for addr in list(self._registered):
            self._te.unregister_memory(addr)
        self._registered.clear()


def _started(bid: int) -> bool:
    """Whether Mooncake's answer to a batch submission is a batch id (0, a negative code, or a
    negative code read as unsigned, says the transfer never started)."""
    return 0 < bid < 2**63


def coalesced(ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(local, remote, length)`` ranges with each run that is contiguous on both sides merged
    into one (empty ranges dropped); order kept."""
    merged: list[tuple[int, int, int]] = []
    for at, to, nbytes in ranges:
        if nbytes <= 0:
            continue
        if merged:
            last_at, last_to, last_n = merged[-1]
            if last_at + last_n == at and last_to + last_n == to:
                merged[-1] = (last_at, last_to, last_n + nbytes)
                continue
        merged.append((at, to, nbytes))
    return merged
