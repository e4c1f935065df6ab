"""Authenticated control connections between pipeline neighbours.

Mooncake moves the tensors; the small control messages (announce, read-done, failures, small
tensors inline) travel on one persistent TCP connection per pair of neighbours, opened at
session setup. Mooncake's own notifications are not used: each one opens a new TCP connection
to the peer's handshake port and waits for a JSON reply (~0.2-0.4 ms on loopback, the largest
part of a small transfer), and they carry nothing that proves who sent them.

A frame is ``!I length | body | 16-byte MAC``; the body holds records ``!HI len(text)
len(payload) | text | payload``. The MAC covers the session (its key), sender, receiver, the
frame's number on that direction (never sent: both ends count, so a replayed, dropped or
reordered frame fails) and the body. The first frame of a connection is the connector's hello
``H|tag|from|to``. The listener that accepts these connections is bound to the job's address,
lives only while a session is being set up, and holds at most ``MAX_PENDING`` connections that
have not yet proven themselves.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import time

from titan_pp_rdma import security
from titan_pp_rdma.errors import PPRdmaTimeout

MAX_FRAME = 4 << 20  # largest body accepted; larger frames are split by the sender
MAX_HELLO = 512
MAX_PENDING = 16  # unauthenticated connections held at once while a session is set up
_RECV_BYTES = 1 << 20
_LEN = struct.Struct("!I")
_REC = struct.Struct("!HI")


def pack_records(records: list[tuple[str, bytes]]) -> bytes:
    """Body of one frame."""
    parts = []
    for text, payload in records:
        raw = text.encode("ascii", "backslashreplace")
        parts += [_REC.pack(len(raw), len(payload)), raw, payload]
    return b"".join(parts)


def unpack_records(body: bytes | memoryview) -> list[tuple[str, memoryview]]:
    """Inverse of :func:`pack_records`; ``ValueError`` on anything malformed."""
    view, out, pos = memoryview(body), [], 0
    while pos < len(view):
        if pos + _REC.size > len(view):
            raise ValueError("truncated record header")
        n_text, n_payload = _REC.unpack_from(view, pos)
        pos += _REC.size
        end = pos + n_text + n_payload
        if end > len(view):
            raise ValueError("record longer than its frame")
        text = bytes(view[pos : pos + n_text]).decode("ascii")  # UnicodeDecodeError is a ValueError
        out.append((text, view[pos + n_text : end]))
        pos = end
    return out


class Channel:
    """One authenticated, non-blocking connection to one peer for one session."""

    def __init__(self, sock: socket.socket, key: bytes, me: int, peer: int, received: int = 0):
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.key, self.me, self.peer = sock, key, me, peer
        self._pending: list[tuple[str, bytes]] = []
        self._pending_bytes = 0
        self._out = bytearray()
        self._in = bytearray()
        self._sent = 0  # frames sent / received on this connection
        self._received = received
        self.eof = False  # the peer closed its end (exited, crashed or closed the session)
        self.broken = ""  # why the stream cannot be trusted any more

    def fileno(self) -> int:
        """For ``select``."""
        return self.sock.fileno()

    def queue(self, text: str, payload: bytes | memoryview = b"") -> None:
        """Add a record to the next frame (sent by :meth:`flush`)."""
        if self._pending_bytes + len(payload) + len(text) > MAX_FRAME - 64:
            self._seal()
        self._pending.append((text, payload))
        self._pending_bytes += len(payload) + len(text) + _REC.size

    def _seal(self) -> None:
        if not self._pending:
            return
        body = pack_records(self._pending)
        tag = security.mac(self.key, self.me, self.peer, self._sent, body)
        self._sent += 1
        self._out += _LEN.pack(len(body)) + body + tag
        self._pending, self._pending_bytes = [], 0

    def flush(self) -> bool:
        """Send what the kernel takes now; True when nothing is left to send."""
        self._seal()
        while self._out and not self.eof:
            try:
                n = self.sock.send(self._out)
            except BlockingIOError:
                return False
            except OSError as exc:
                self.eof = True
                self.broken = self.broken or f"send failed: {exc}"
                return False
            del self._out[:n]
        return not self._out

    @property
    def wants_write(self) -> bool:
        """Whether frames wait for room in the socket."""
        return bool(self._out or self._pending)

    def receive(self) -> list[tuple[str, memoryview]]:
        """Every record of the complete, verified frames that arrived."""
        while not self.eof:
            try:
                chunk = self.sock.recv(_RECV_BYTES)
            except BlockingIOError:
                break
            except OSError as exc:
                chunk, self.broken = b"", self.broken or f"receive failed: {exc}"
            if not chunk:
                self.eof = True
                break
            self._in += chunk
            if len(chunk) < _RECV_BYTES:
                # The socket had no more: asking again costs a syscall and an exception on the
                # message's critical path; what arrives meanwhile wakes the next select.
                break
        records: list[tuple[str, memoryview]] = []
        while not self.broken and len(self._in) >= _LEN.size:
            (length,) = _LEN.unpack_from(self._in, 0)
            if length > MAX_FRAME:
                self._break("oversized_frame", f"frame of {length} B from rank {self.peer}")
                break
            end = _LEN.size + length + security.MAC_BYTES
            if len(self._in) < end:
                break
            body = self._in[_LEN.size : _LEN.size + length]  # a copy, writable (torch.frombuffer)
            tag = bytes(self._in[end - security.MAC_BYTES : end])
            del self._in[:end]
            if not security.verify(self.key, self.peer, self.me, self._received, body, tag):
                self._break("bad_mac", f"frame {self._received} from rank {self.peer}")
                break
            self._received += 1
            try:
                records += unpack_records(body)
            except ValueError as exc:
                security.reject("malformed_frame", f"from rank {self.peer}: {exc}")
        return records

    def _break(self, reason: str, detail: str) -> None:
        # Once one frame fails, the byte stream cannot be re-synchronised: nothing after it is
        # trusted. On an established TCP connection this takes an on-path attacker or a bug.
        security.reject(reason, detail)
        self.broken = f"{reason}: {detail}"

    def close(self) -> None:
        """Close the socket (the peer sees end-of-file)."""
        self.eof = True
        self.sock.close()


def open_listener(host: str) -> socket.socket:
    """A listening socket on ``host`` (the job's address, never the wildcard), any free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(MAX_PENDING)
    sock.setblocking(False)
    return sock


def connect(host: str, port: int, key: bytes, me: int, peer: int, tag: str, timeout_s: float):
    """Open the connection to ``peer``'s listener and introduce ourselves."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    channel = Channel(sock, key, me, peer)
    channel.queue(f"H|{tag}|{me}|{peer}")
    deadline = time.monotonic() + timeout_s
    while not channel.flush():
        if channel.eof or time.monotonic() > deadline:
            raise PPRdmaTimeout(f"pp_rdma: could not greet pipeline rank {peer} at {host}:{port}")
        select.select([], [channel.sock], [], 0.01)
    return channel


def _hello(buf: bytearray, key: bytes, me: int, tag: str, expected: set[int]) -> int | None:
    """The peer rank a complete hello in ``buf`` proves, None when incomplete; ValueError if bad."""
    if len(buf) < _LEN.size:
        return None
    (length,) = _LEN.unpack_from(buf, 0)
    if length > MAX_HELLO:
        raise ValueError(f"hello of {length} B")
    end = _LEN.size + length + security.MAC_BYTES
    if len(buf) < end:
        return None
    body = bytes(buf[_LEN.size : _LEN.size + length])
    records = unpack_records(body)
    fields = records[0][0].split("|") if len(records) == 1 else []
    if len(fields) != 4 or fields[0] != "H" or fields[1] != tag or fields[3] != str(me):
        raise ValueError(f"not a hello for this session: {body[:80]!r}")
    sender = int(fields[2])
    if sender not in expected:
        raise ValueError(f"hello from rank {sender}, expected one of {sorted(expected)}")
    if not security.verify(key, sender, me, 0, body, bytes(buf[end - security.MAC_BYTES : end])):
        raise ValueError(f"hello claiming rank {sender} does not carry the job's MAC")
    del buf[:end]
    return sender


def accept(
    listener: socket.socket, key: bytes, me: int, tag: str, expected: set[int], timeout_s: float
) -> dict[int, Channel]:
    """Accept one authenticated connection from each rank in ``expected``.

    Anything else that connects meanwhile (a port scan, garbage, a forged hello, a connection
    that never speaks) is rejected and counted; at most ``MAX_PENDING`` unproven connections are
    held, the oldest dropped first.
    """
    deadline = time.monotonic() + timeout_s
    pending: dict[socket.socket, bytearray] = {}
    got: dict[int, Channel] = {}
    try:
        while set(got) != expected:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(expected - set(got))
                raise PPRdmaTimeout(
                    f"pp_rdma: pipeline ranks {missing} did not connect to rank {me} within "
                    f"{timeout_s:g} s (TITAN_PP_RDMA_TIMEOUT_S)"
                )
            ready, _, _ = select.select([listener, *pending], [], [], min(left, 0.5))
            for sock in ready:
                if sock is listener:
                    _accept_one(listener, pending)
                    continue
                buf = pending[sock]
                try:
                    chunk = sock.recv(4096)
                    if not chunk:
                        raise ValueError("closed before a complete hello")
                    buf += chunk
                    peer = _hello(buf, key, me, tag, expected - set(got))
                except (OSError, ValueError) as exc:
                    security.reject("unauthenticated_connection", f"rank {me}'s listener: {exc}")
                    del pending[sock]
                    sock.close()
                    continue
                if peer is not None:
                    del pending[sock]
                    got[peer] = Channel(sock, key, me, peer, received=1)
                    got[peer]._in += buf  # frames the peer sent right after its hello
    except BaseException:
        for channel in got.values():
            channel.close()
        raise
    finally:
        for sock in pending:
            security.reject("unauthenticated_connection", f"rank {me}'s listener: never spoke")
            sock.close()
    return got


def _accept_one(listener: socket.socket, pending: dict[socket.socket, bytearray]) -> None:
    try:
        sock, _ = listener.accept()
    except OSError as exc:  # the client gave up already
        if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED):
            raise
        return
    sock.setblocking(False)
    if len(pending) >= MAX_PENDING:
        oldest = next(iter(pending))
        del pending[oldest]
        oldest.close()
        security.reject("unauthenticated_connection", "too many unproven connections")
    pending[sock] = bytearray()
