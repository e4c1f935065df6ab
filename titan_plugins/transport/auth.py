"""A job secret shared through a file, and message authentication with it.

For peers that share no torch.distributed store (a trainer and the SGLang engines it feeds run in
separate jobs): the launcher writes one random secret to a file only its user can read and hands
its path to both sides. The secret never crosses the wire; each message carries an HMAC-SHA256
over its purpose, the nonces that bind it to one exchange, and its body.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

SECRET_HEX_DIGITS = 64


class SecretError(ValueError):
    """The secret file is missing, readable by others, or malformed (the message says which)."""


def read_secret(path: str, knob: str) -> bytes:
    """The 32-byte secret in ``path`` (64 hex digits; surrounding whitespace ignored).

    :param knob: the variable that named the file, for the messages.
    :raises SecretError: no such file, a file group or others may read, or not 64 hex digits.
    """
    if not path:
        raise SecretError(f"{knob} is not set: give both sides the path of the job's secret file")
    try:
        info = os.stat(path)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"{knob}={path}: group or others may read it (mode {stat.S_IMODE(info.st_mode):o});"
                f" chmod 600 {path}"
            )
        with open(path, "rb") as f:
            text = f.read(SECRET_HEX_DIGITS + 64).strip()
    except OSError as err:
        raise SecretError(f"{knob}={path}: cannot read it ({err.strerror})") from err
    try:
        if len(text) != SECRET_HEX_DIGITS:
            raise ValueError
        return bytes.fromhex(text.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise SecretError(
            f"{knob}={path}: expected {SECRET_HEX_DIGITS} hex digits (write one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE; chmod 600 FILE`)"
        ) from None


def write_secret(path: str) -> bytes:
    """Create ``path`` (owner-only) holding a new random secret; returns the secret."""
    value = secrets.token_bytes(SECRET_HEX_DIGITS // 2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value.hex() + "\n")
    return value


def sign(secret: bytes, purpose: str, *parts: bytes) -> str:
    """HMAC-SHA256 (hex) of ``purpose`` and ``parts``, each length-prefixed so no two different
    messages share an input."""
    state = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (purpose.encode(), *parts):
        state.update(len(part).to_bytes(8, "big"))
        state.update(part)
    return state.hexdigest()


def check(secret: bytes, tag: object, purpose: str, *parts: bytes) -> bool:
    """Constant-time check of a tag made by :func:`sign` (False for a non-string tag)."""
    return isinstance(tag, str) and hmac.compare_digest(sign(secret, purpose, *parts), tag)


def nonce() -> str:
    """A fresh 128-bit nonce, hex."""
    return secrets.token_hex(16)
