"""Stream one Kineto (Chrome-trace JSON) file, plain or gzipped, in bounded memory.

The decompressed text is read in chunks and cut into one piece per event at the ``}, {``
boundaries between the objects of ``traceEvents``.  Only pieces whose ``cat`` is wanted are
JSON-parsed (orjson when installed), so the CPU-side bulk of a trace (cpu_op, flows) costs a
regex search each instead of a full parse, and memory is one chunk plus what the caller keeps.
A piece that fails to parse (a ``}, {`` inside an args string) is retried joined with its
neighbours; what still fails is counted in ``bad_events``.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from typing import Any

try:  # optional speed-up; the stdlib parser gives the same results
    import orjson

    _loads = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError, ValueError)
except ImportError:  # pragma: no cover - exercised only where orjson is absent
    _loads = json.loads
    _JSONError = (ValueError,)

SEP = re.compile(rb"(\}\s*,\s*\{)")  # captured: a rejoin restores the exact text
CAT = re.compile(rb'"cat"\s*:\s*"([^"]*)"')
ARRAY_START = re.compile(rb'"traceEvents"\s*:\s*\[\s*')
ARRAY_END = re.compile(rb"\}\s*\]")
CHUNK = 1 << 20
MAX_HEADER = 256 << 20

GPU_CATS = frozenset({b"kernel", b"gpu_memcpy", b"gpu_memset"})
LAUNCH_CATS = frozenset({b"cuda_runtime", b"cuda_driver", b"musa_runtime", b"musa_driver"})
STEP_CATS = frozenset({b"user_annotation", b"cpu_op"})


class TraceError(Exception):
    """A trace file that cannot be analysed; the message says what to do about it."""


def _open(path: str):
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _is_wanted(piece: bytes) -> bool:
    m = CAT.search(piece)
    if m is None:
        return False
    cat = m.group(1)
    if cat in GPU_CATS or cat in LAUNCH_CATS:
        return True
    return cat in STEP_CATS and b"ProfilerStep#" in piece


class TraceReader:
    """Iterate the wanted events of one trace; ``header`` holds the top-level metadata."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.header: dict[str, Any] = {}
        self.n_events = 0  # pieces seen: an unparsed event with "}, {" inside counts twice
        self.bad_events = 0

    def events(self) -> Iterator[dict[str, Any]]:
        """Yield GPU events, launch (runtime/driver) events and ProfilerStep annotations."""
        try:
            yield from self._events()
        except (EOFError, OSError, zlib.error) as exc:
            raise TraceError(
                f"corrupt or truncated file ({type(exc).__name__}: {exc}); re-copy the trace "
                "or re-export it with torch.profiler"
            ) from None

    def _events(self) -> Iterator[dict[str, Any]]:
        with _open(self.path) as fh:
            buf = b""
            in_array = False
            while True:
                chunk = fh.read(CHUNK)
                if in_array:
                    buf += chunk
                else:
                    buf += chunk
                    m = ARRAY_START.search(buf)
                    if m is None:
                        if not chunk or len(buf) > MAX_HEADER:
                            raise TraceError(
                                'no "traceEvents" array: not a Kineto/Chrome trace JSON file'
                            )
                        continue
                    if len(buf) - m.end() < 2 and chunk:
                        continue  # need the first byte of the array
                    self._header(buf[: m.start()] + b'"traceEvents": []}')
                    buf = buf[m.end() :]
                    if buf.startswith(b"]"):
                        self._trailer(buf[1:])
                        return
                    if not buf.startswith(b"{"):
                        raise TraceError("traceEvents is not an array of event objects")
                    buf = buf[1:]
                    in_array = True
                if chunk:
                    parts = SEP.split(buf)  # piece, separator, piece, ..., remainder
                    buf = parts.pop()
                    yield from self._parse(parts)
                else:
                    yield from self._finish(buf)
                    return

    def _parse(self, parts: list[bytes]) -> Iterator[dict[str, Any]]:
        pieces, seps = parts[0::2], parts[1::2]
        self.n_events += len(pieces)
        i, n = 0, len(pieces)
        while i < n:
            p = pieces[i]
            if _is_wanted(p):
                try:
                    yield _loads(b"{" + p + b"}")
                except _JSONError:
                    # join forward until it parses: the cut was inside a string or nested list
                    for j in range(i + 1, min(n, i + 16)):
                        p = p + seps[j - 1] + pieces[j]
                        try:
                            ev = _loads(b"{" + p + b"}")
                        except _JSONError:
                            continue
                        self.n_events -= j - i
                        i = j
                        yield ev
                        break
                    else:
                        self.bad_events += 1
            i += 1

    def _finish(self, rest: bytes) -> Iterator[dict[str, Any]]:
        for m in ARRAY_END.finditer(rest):
            last = rest[: m.start()]
            try:
                ev = _loads(b"{" + last + b"}")
            except _JSONError:
                continue
            self.n_events += 1
            if _is_wanted(last):
                yield ev
            self._trailer(rest[m.end() :])
            return
        raise TraceError(
            "truncated JSON: the traceEvents array never closes (file cut off while "
            "copying or while the profiler was writing it); re-copy or re-export the trace"
        )

    def _header(self, text: bytes) -> None:
        try:
            head = _loads(text)
        except _JSONError as exc:
            raise TraceError(f"unreadable trace header ({exc})") from None
        head.pop("traceEvents", None)
        self.header.update(head)

    def _trailer(self, text: bytes) -> None:
        text = text.strip().lstrip(b",").strip()
        if text in (b"", b"}"):
            return
        try:
            self.header.update(_loads(b"{" + text))
        except _JSONError:
            pass  # metadata after the events is optional; the events are complete
