"""The job secret, message authentication, and the record of what was rejected.

Trust model: the torch.distributed store is the root of trust (every rank reaches it already to
rendezvous; whoever can read it can join torch.distributed itself). The first rank to ask puts
a random 256-bit job secret there (``compare_set``: one winner, every rank reads the same).
Each pipeline session derives its own key from it and its session tag, and every control frame
carries an HMAC-SHA256 (truncated to 128 bits) over the session, sender, receiver, a per-direction
frame counter and the frame body. A frame that does not check out is rejected: logged (rate
limited), counted in ``titan-plugins report``, never acted on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
import threading
import time
from collections import Counter
from typing import Any

logger = logging.getLogger("titan_plugins.pp_rdma")
MAC_BYTES = 16
SECRET_KEY = "titan_pp_rdma/job_secret"
_LOCK = threading.Lock()
REJECTED: Counter[str] = Counter()
_LAST_LOG: dict[str, float] = {}
_LOG_EVERY_S = 10.0
_KEYED: dict[bytes, Any] = {}
_MAX_KEYED = 64


def job_secret(store: Any) -> bytes:
    """The job's shared secret from the torch.distributed store (created by the first caller)."""
    mine = secrets.token_hex(32)
    value = store.compare_set(SECRET_KEY, "", mine)
    value = value.decode() if isinstance(value, bytes) else str(value)
    if len(value) != 64:
        raise ValueError(f"malformed pp_rdma job secret in the store (key {SECRET_KEY})")
    return bytes.fromhex(value)


def session_key(secret: bytes, tag: str) -> bytes:
    """The key of one pipeline session: frames of another session (or job) never verify."""
    return hmac.digest(secret, b"titan_pp_rdma session\0" + tag.encode(), hashlib.sha256)


def _keyed(key: bytes) -> Any:
    """An HMAC-SHA256 state with ``key`` already absorbed (a session uses one key for its life)."""
    state = _KEYED.get(key)
    if state is None:
        if len(_KEYED) >= _MAX_KEYED:  # sessions come and go: never grow without bound
            _KEYED.clear()
        state = _KEYED[key] = hmac.new(key, digestmod=hashlib.sha256)
    return state


def mac(key: bytes, sender: int, receiver: int, counter: int, body: bytes) -> bytes:
    """The tag of one frame (``sender`` -> ``receiver``, the ``counter``-th on that direction).

    HMAC-SHA256 of the header and body, from a copy of the keyed state: the same tag as
    ``hmac.digest(key, header + body, sha256)`` without the key schedule or a copy of the body
    per frame (on a core that slept, the one-shot call cost ~60 us of a message's latency).
    """
    state = _keyed(key).copy()
    state.update(struct.pack("!QQQ", sender, receiver, counter))
    state.update(body)
    return state.digest()[:MAC_BYTES]


def verify(key: bytes, sender: int, receiver: int, counter: int, body: bytes, tag: bytes) -> bool:
    """Constant-time check of a frame's tag."""
    return hmac.compare_digest(mac(key, sender, receiver, counter, body), tag)


def reject(reason: str, detail: str) -> None:
    """Count a rejected message or connection and log it (at most every 10 s per reason)."""
    now = time.monotonic()
    with _LOCK:
        REJECTED[reason] += 1
        count = REJECTED[reason]
        due = now - _LAST_LOG.get(reason, -_LOG_EVERY_S) >= _LOG_EVERY_S
        if due:
            _LAST_LOG[reason] = now
    if due:
        logger.warning(
            "pp_rdma: rejected %s (%d so far; never acted on): %s", reason, count, detail[:300]
        )


def rejected() -> dict[str, int]:
    """Counts of rejected input by reason, for ``titan-plugins report``."""
    with _LOCK:
        return dict(REJECTED)
