"""The frame around a trace's events: where the ``traceEvents`` array opens and ends, what the
top level holds around it, and how large an event and a string may be.

The limits bound what one file can cost: the header (the text before the array) is at most
``MAX_HEADER``; an event's text at most ``max_event`` (``--max-event-mb``, default
``MAX_EVENT``): the reader refuses the file as soon as the text read shows a longer one, so a
decompressed monster costs about that many bytes of inflation, whatever its size; a string in a
parsed event at most ``max_string`` (``--max-string-mb``, default ``MAX_STRING``), else the
event is dropped and counted.  Kineto writes events of a few KB and kernel names of a few
hundred bytes; PyTorch cuts long rank lists short ("...").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .fastpath import Codec

SEP = re.compile(rb"(\}\s*,\s*\{)")  # captured: a rejoin restores the exact text
ARRAY_START = re.compile(rb'"traceEvents"\s*:\s*\[\s*')
ARRAY_END = re.compile(rb"\}\s*\]")
MIB = 1 << 20
MAX_HEADER = 64 * MIB
MAX_EVENT = 16 * MIB  # bytes of one event's text
MAX_STRING = 4 * MIB  # bytes of one string in a parsed event
REOPEN = 64 << 10  # bytes back from the end where an unfinished array opening may begin


class TraceError(Exception):
    """A trace file that cannot be analysed; the message says what to do about it."""


def open_array(chunks: Iterator[bytes]) -> tuple[bytes, int, int]:
    """Read ``chunks`` until the events array opens: (text so far, start of ``"traceEvents"``,
    end of its ``[``)."""
    # the header grows in place and is searched from where the opening can still begin:
    # joining and searching it whole per read cost its square (seconds for 64 MiB)
    head = bytearray()
    m = None
    at = 0
    for chunk in chunks:
        head += chunk
        m = ARRAY_START.search(head, at)
        if m is not None and len(head) > m.end():
            break
        at = m.start() if m is not None else max(0, len(head) - REOPEN)
        if len(head) > MAX_HEADER:
            raise TraceError('no "traceEvents" array in the first 64 MiB: not a Kineto trace')
    if m is None:
        what = "empty file" if not head.strip() else 'no "traceEvents" array'
        raise TraceError(f"{what}: not a Kineto/Chrome trace JSON file")
    return bytes(head), m.start(), m.end()


def check_size(buf: bytes, limit: int, bytes_read: int) -> None:
    """Raise TraceError if an event of ``buf`` (the last one perhaps not complete yet) is over
    ``limit`` bytes; ``bytes_read``: how much text the file has given so far."""
    if max(map(len, SEP.split(buf)[0::2])) > limit:
        raise TraceError(
            f"an event of more than {limit / MIB:g} MiB (the limit per event; a Kineto event is "
            f"a few KB): file refused after reading {bytes_read / MIB:.1f} MiB of text; if the "
            "trace is genuine, raise the limit with --max-event-mb N"
        )


def long_string(ev: Any, limit: int) -> bool:
    """Whether ``ev`` holds a string (a key or a value, at any depth) over ``limit`` bytes."""
    stack: list[Any] = [ev]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if len(x) > limit or (
                4 * len(x) > limit and len(x.encode("utf-8", "surrogatepass")) > limit
            ):
                return True
        elif isinstance(x, dict):
            stack += x.keys()
            stack += x.values()
        elif isinstance(x, list):
            stack += x
    return False


def closes(tail: bytes, codec: Codec) -> bool:
    """Whether ``tail``, what follows a candidate end of the events array, ends the file's
    top-level object (nothing, ``}``, or more ``"key": value`` members and ``}``)."""
    text = tail.strip()
    if text in (b"", b"}"):
        return True
    if not text.startswith(b",") or not text.endswith(b"}"):
        return False
    try:
        return isinstance(codec.loads(b"{" + text[1:]), dict)
    except codec.json_errors:
        return False


def header(text: bytes, codec: Codec) -> dict[str, Any]:
    """The top-level members before the events (``text`` ends where the array begins)."""
    try:
        head = codec.loads(text + b'"traceEvents": []}')
    except codec.json_errors as exc:
        raise TraceError(f"unreadable trace header ({exc})") from None
    if not isinstance(head, dict):
        raise TraceError("the trace's top level is not a JSON object")
    head.pop("traceEvents", None)
    return head


def trailer(text: bytes, codec: Codec) -> dict[str, Any]:
    """The top-level members after the events (optional: nothing when unreadable)."""
    text = text.strip().lstrip(b",").strip()
    if text in (b"", b"}"):
        return {}
    try:
        tail = codec.loads(b"{" + text)
    except codec.json_errors:
        return {}  # metadata after the events is optional; the events are complete
    return tail if isinstance(tail, dict) else {}
