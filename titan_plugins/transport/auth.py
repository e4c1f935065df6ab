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

from titan_plugins.values import shown_value

SECRET_HEX_DIGITS = 64


class SecretError(ValueError):
    """The secret file is missing, not a regular file, readable by others, or malformed (the
    message says which)."""


_HOW_TO_WRITE = (
    "write one with `python -c 'import secrets; print(secrets.token_hex(32))' > FILE; "
    "chmod 600 FILE`"
)


def secret_problem(path: str) -> str | None:
    """What is wrong with ``path`` as the job's secret file (None: nothing): missing, not a
    regular file (a directory, a FIFO, a device), readable by group or others, or not 64 hex
    digits. Never blocks: a FIFO is refused from its ``stat``, before any open."""
    try:
        read_secret(path, "")
    except SecretError as err:
        return str(err)
    return None


def read_secret(path: str, knob: str) -> bytes:
    """The 32-byte secret in ``path`` (64 hex digits; surrounding whitespace ignored).

    :param knob: the variable that named the file, for the messages ("": the messages give only
        the reason, for a caller that names the variable and the value itself).
    :raises SecretError: not set, no such file, not a regular file, a file group or others may
        read, or not 64 hex digits.
    """
    if not path:
        raise SecretError(f"{knob} is not set: give both sides the path of the job's secret file")
    # the path once, shortened when long (a 400-character path filled the terminal), and the
    # fix through the variable, which a shortened path could not be pasted into
    where = f"{knob}={shown_value(path)}: " if knob else ""
    fix_file = f'"${knob}"' if knob else "the file"
    try:
        # stat first: opening a FIFO (even read-only) waits for a writer, and a device may act
        # on an open; then open non-blocking and check that it is still the same regular file
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"{where}not a regular file ({_kind(info.st_mode)}); {_HOW_TO_WRITE}")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"{where}group or others may read it (mode {stat.S_IMODE(info.st_mode):o}); "
                f"chmod 600 {fix_file}"
            )
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            opened = os.fstat(f.fileno())
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                raise SecretError(f"{where}it was replaced while being read; check who writes it")
            text = f.read(SECRET_HEX_DIGITS + 64).strip()
    except OSError as err:
        raise SecretError(
            f"{where}cannot read it ({err.strerror or err}); {_HOW_TO_WRITE}"
        ) from None
    try:
        if len(text) != SECRET_HEX_DIGITS:
            raise ValueError
        return bytes.fromhex(text.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise SecretError(
            f"{where}expected {SECRET_HEX_DIGITS} hex digits ({_HOW_TO_WRITE})"
        ) from None


def _kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, word in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return word
    return f"file type {stat.S_IFMT(mode):o}"


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
