"""The messages between a trainer and an engine, and their checks.

They travel inside SGLang's own ``update_weights_from_tensor`` request (``load_format`` names
this plugin; the payload is this module's JSON, never a pickle) and come back in its reply
message. Every field is checked for type and bounds before use; an engine answers a message
that fails a check with the reason and changes nothing.

- ``hello``: the trainer proves the secret over a fresh nonce; the engine answers with its
  landing region (Mooncake session, address, size), the tensor table and a nonce of its own,
  signed over the trainer's nonce (the trainer knows the answer is the engine's).
- ``commit``: the trainer's version and the digest (BLAKE3) of every tensor it wrote, signed over
  the engine's nonce (a replayed commit, or one from a peer without the secret, never verifies).
- ``abort``: the trainer gives up, signed over the engine's nonce (the engine closes the
  landing region at once).
"""

from __future__ import annotations

import json
import re
from typing import Any

from titan_plugins.transport import auth
from titan_weight_sync.layout import DTYPES, Slot
from titan_weight_sync.load_format import LOAD_FORMAT

__all__ = ["LOAD_FORMAT", "BadMessage"]
MAGIC = b"titan_weight_sync/1\n"
REPLY_KEY = "titan_weight_sync"
MAX_MESSAGE_BYTES = 64 << 20
MAX_TENSORS = 1_000_000
MAX_NAME = 1024
MAX_VERSION = 256
MAX_DIMS = 8
_HEX = re.compile(r"[0-9a-f]+")
OPS = ("hello", "commit", "abort")


class BadMessage(ValueError):
    """A message that fails a check (the text says which field and why)."""


def canonical(obj: Any) -> bytes:
    """The one JSON encoding both sides sign."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def encode(message: dict[str, Any]) -> bytes:
    """A request payload."""
    return MAGIC + canonical(message)


def decode(raw: object) -> dict[str, Any]:
    """A request payload, checked for framing, size and op (the fields are checked by the op's
    reader)."""
    if not isinstance(raw, (bytes, bytearray)) or not raw.startswith(MAGIC):
        raise BadMessage("not a titan_weight_sync message")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message of {len(raw)} bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        message = json.loads(bytes(raw[len(MAGIC) :]))
    except ValueError as err:
        raise BadMessage(f"malformed JSON ({err})") from None
    if not isinstance(message, dict) or message.get("op") not in OPS:
        raise BadMessage(f"unknown op (expected one of {', '.join(OPS)})")
    return message


def hex_field(message: dict[str, Any], key: str, digits: int) -> str:
    """``message[key]`` as exactly ``digits`` lower-case hex digits."""
    value = message.get(key)
    if not isinstance(value, str) or len(value) != digits or not _HEX.fullmatch(value):
        raise BadMessage(f"{key}: expected {digits} lower-case hex digits")
    return value


def text_field(message: dict[str, Any], key: str, limit: int) -> str:
    """``message[key]`` as a non-empty printable string of at most ``limit`` characters."""
    value = message.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= limit or not value.isprintable():
        raise BadMessage(f"{key}: expected printable text of 1..{limit} characters")
    return value


# ------------------------------------------------------------------ hello
def hello_request(secret: bytes, trainer_nonce: str) -> bytes:
    """The trainer's hello."""
    tag = auth.sign(secret, "hello", trainer_nonce.encode())
    return encode({"op": "hello", "trainer_nonce": trainer_nonce, "mac": tag})


def read_hello(secret: bytes, message: dict[str, Any]) -> str:
    """The trainer nonce of an authentic hello."""
    trainer_nonce = hex_field(message, "trainer_nonce", 32)
    if not auth.check(secret, message.get("mac"), "hello", trainer_nonce.encode()):
        raise BadMessage("hello not signed with the job's secret")
    return trainer_nonce


def hello_reply(secret: bytes, trainer_nonce: str, body: dict[str, Any]) -> str:
    """The engine's answer to a hello, signed over the trainer's nonce."""
    tag = auth.sign(secret, "engine-hello", trainer_nonce.encode(), canonical(body))
    return json.dumps({REPLY_KEY: {**body, "mac": tag}})


def read_hello_reply(secret: bytes, trainer_nonce: str, text: str) -> dict[str, Any]:
    """The engine's landing description from its reply, after checking it is the engine's."""
    body = reply_body(text)
    tag = body.pop("mac", None)
    if not auth.check(secret, tag, "engine-hello", trainer_nonce.encode(), canonical(body)):
        raise BadMessage("the engine's hello reply is not signed with the job's secret")
    return body


def slots_field(body: dict[str, Any]) -> list[Slot]:
    """The tensor table of a hello reply, checked."""
    rows = body.get("slots")
    if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
        raise BadMessage("slots: expected a list")
    slots = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4):
            raise BadMessage("slots: expected [name, dtype, shape, offset] rows")
        name, dtype, shape, offset = row
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or dtype not in DTYPES:
            raise BadMessage(f"slots: bad name or dtype in {str(row)[:200]}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise BadMessage(f"slots: bad shape for {name}")
        if not all(isinstance(s, int) and 0 <= s < 1 << 40 for s in [*shape, offset]):
            raise BadMessage(f"slots: bad shape or offset for {name}")
        slots.append(Slot(name, dtype, tuple(shape), offset))
    return slots


# ------------------------------------------------------------------ commit
def commit_request(
    secret: bytes, engine_nonce: str, version: str, digests: list[tuple[str, str]]
) -> bytes:
    """The trainer's commit: its version and each written tensor's digest, in table order."""
    rows = [list(d) for d in digests]
    tag = auth.sign(secret, "commit", engine_nonce.encode(), version.encode(), canonical(rows))
    return encode(
        {
            "op": "commit",
            "engine_nonce": engine_nonce,
            "version": version,
            "digests": rows,
            "mac": tag,
        }
    )


def read_commit(
    secret: bytes, engine_nonce: str, message: dict[str, Any]
) -> tuple[str, list[tuple[str, str]]]:
    """``(version, digests)`` of an authentic commit for this engine's current nonce."""
    nonce = hex_field(message, "engine_nonce", 32)
    version = text_field(message, "version", MAX_VERSION)
    rows = message.get("digests")
    if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
        raise BadMessage("digests: expected a list")
    digests: list[tuple[str, str]] = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)):
            raise BadMessage("digests: expected [name, digest] rows")
        digests.append((row[0], hex_field({"d": row[1]}, "d", 64)))
    signed = (nonce.encode(), version.encode(), canonical([list(d) for d in digests]))
    if not auth.check(secret, message.get("mac"), "commit", *signed):
        raise BadMessage("commit not signed with the job's secret")
    if nonce != engine_nonce:
        raise BadMessage("commit for another exchange (a replay, or a hello since): refused")
    return version, digests


def commit_reply(secret: bytes, engine_nonce: str, version: str, loaded: int) -> str:
    """The engine's answer to a commit that loaded ``loaded`` tensors."""
    tag = auth.sign(secret, "engine-commit", engine_nonce.encode(), version.encode())
    return json.dumps({REPLY_KEY: {"loaded": loaded, "version": version, "mac": tag}})


def read_commit_reply(secret: bytes, engine_nonce: str, version: str, text: str) -> int:
    """How many tensors the engine loaded, after checking the reply is the engine's."""
    body = reply_body(text)
    if not auth.check(
        secret, body.get("mac"), "engine-commit", engine_nonce.encode(), version.encode()
    ):
        raise BadMessage("the engine's commit reply is not signed with the job's secret")
    loaded = body.get("loaded")
    if not isinstance(loaded, int):
        raise BadMessage("commit reply without a count")
    return loaded


def abort_request(secret: bytes, engine_nonce: str) -> bytes:
    """The trainer gives up this exchange (the engine closes its landing region at once)."""
    tag = auth.sign(secret, "abort", engine_nonce.encode())
    return encode({"op": "abort", "engine_nonce": engine_nonce, "mac": tag})


def read_abort(secret: bytes, engine_nonce: str, message: dict[str, Any]) -> None:
    """Check an abort is the trainer's, for this exchange."""
    nonce = hex_field(message, "engine_nonce", 32)
    if nonce != engine_nonce or not auth.check(secret, message.get("mac"), "abort", nonce.encode()):
        raise BadMessage("abort not signed with the job's secret for this exchange")


def reply_body(text: str) -> dict[str, Any]:
    """The JSON object an engine put at the start of its reply message (SGLang may append a
    sentence of its own after it)."""
    try:
        found, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        raise BadMessage(f"the engine's reply is not ours: {text[:300]}") from None
    body = found.get(REPLY_KEY) if isinstance(found, dict) else None
    if not isinstance(body, dict):
        raise BadMessage(f"the engine's reply is not ours: {text[:300]}")
    return body
