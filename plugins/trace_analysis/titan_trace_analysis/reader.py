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

    loads = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError, ValueError)

    def dumps(obj: Any) -> bytes:
        """JSON bytes of ``obj`` (orjson when installed)."""
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - exercised only where orjson is absent
    loads = json.loads
    _JSONError = (ValueError,)

    def dumps(obj: Any) -> bytes:
        """JSON bytes of ``obj`` (orjson when installed)."""
        return json.dumps(obj).encode()


try:  # optional: ISA-L inflates gzip 2-4x faster than zlib
    from isal import igzip as _gzip
    from isal import isal_zlib

    _GZ_ERRORS: tuple[type[Exception], ...] = (EOFError, OSError, zlib.error, isal_zlib.error)
except ImportError:  # pragma: no cover - exercised only where isal is absent
    _gzip = gzip
    _GZ_ERRORS = (EOFError, OSError, zlib.error)

SEP = re.compile(rb"(\}\s*,\s*\{)")  # captured: a rejoin restores the exact text
CAT = re.compile(rb'"cat"\s*:\s*"([^"]*)"')
# one regex call per event decides; ProfilerStep annotations are found by a scan of the chunk
WANTED = re.compile(
    rb'"cat"\s*:\s*"(?:kernel|gpu_memcpy|gpu_memset|cuda_runtime|cuda_driver|musa_runtime|musa_driver)"'
)
STEP_MARK = b"ProfilerStep#"
# launch calls only matter for (correlation -> CPU time): read those two fields without a parse
LAUNCH = re.compile(rb'"ts"\s*:\s*(-?[0-9][0-9.eE+-]*)\s*,.*?"correlation"\s*:\s*(\d+)', re.S)
HOLD = 4
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
        return _gzip.open(path, "rb")
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
        self.launches: dict[int, float] = {}  # correlation id -> CPU launch time

    def events(self) -> Iterator[dict[str, Any]]:
        """Yield GPU events and ProfilerStep annotations; launch (runtime/driver) calls go to
        ``launches`` (or are yielded when their fields are not where the fast path looks)."""
        try:
            yield from self._events()
        except _GZ_ERRORS as exc:
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
                    has_step = STEP_MARK in buf
                    parts = SEP.split(buf)  # piece, separator, piece, ..., remainder
                    # hold the last HOLD pieces back: a rejoin may need them as context
                    keep = min(len(parts), 2 * HOLD + 1)
                    yield from self._parse(parts, has_step, (len(parts) - keep + 1) // 2)
                    buf = b"".join(parts[len(parts) - keep :])
                else:
                    yield from self._finish(buf)
                    return

    def _parse(
        self, parts: list[bytes], has_step: bool, limit: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Events of ``parts`` (piece, separator, piece, ...) among the first ``limit`` pieces."""
        pieces, seps = parts[0::2], parts[1::2]
        n = len(pieces) if limit is None else limit
        self.n_events += n
        selected = list(filter(WANTED.search, pieces[:n]))
        if has_step:
            selected += [p for p in pieces[:n] if STEP_MARK in p and not WANTED.search(p)]
        consumed: set[int] = set()
        launches = self.launches
        for p in selected:
            if b'_runtime"' in p or b'_driver"' in p:
                m = LAUNCH.search(p)
                if m is not None:
                    launches[int(m[2])] = float(m[1])
                    continue
            try:
                yield loads(b"{" + p + b"}")
            except _JSONError:
                i = pieces.index(p)
                if i in consumed:
                    continue
                ev = self._rejoin(pieces, seps, i, consumed)
                if ev is None:
                    self.bad_events += 1
                elif _is_wanted(b"".join(pieces[min(consumed) : max(consumed) + 1])):
                    yield ev

    def _rejoin(
        self, pieces: list[bytes], seps: list[bytes], i: int, consumed: set[int]
    ) -> dict[str, Any] | None:
        """Join piece ``i`` with its neighbours until it parses (the cut was inside a string
        or a nested list); the indices used go into ``consumed``."""
        for lo in range(i, max(-1, i - 4), -1):
            for hi in range(i if lo < i else i + 1, min(len(pieces), i + 16)):
                text = pieces[lo] + b"".join(seps[k - 1] + pieces[k] for k in range(lo + 1, hi + 1))
                try:
                    ev = loads(b"{" + text + b"}")
                except _JSONError:
                    continue
                consumed.clear()
                consumed.update(range(lo, hi + 1))
                self.n_events -= hi - lo
                return ev
        return None

    def _finish(self, rest: bytes) -> Iterator[dict[str, Any]]:
        for m in ARRAY_END.finditer(rest):
            body = rest[: m.start()]
            try:
                loads(b"[{" + body + b"}]")  # the held-back tail is whole events: the end
            except _JSONError:
                continue
            yield from self._parse(SEP.split(body), STEP_MARK in body)
            self._trailer(rest[m.end() :])
            return
        raise TraceError(
            "truncated JSON: the traceEvents array never closes (file cut off while "
            "copying or while the profiler was writing it); re-copy or re-export the trace"
        )

    def _header(self, text: bytes) -> None:
        try:
            head = loads(text)
        except _JSONError as exc:
            raise TraceError(f"unreadable trace header ({exc})") from None
        head.pop("traceEvents", None)
        self.header.update(head)

    def _trailer(self, text: bytes) -> None:
        text = text.strip().lstrip(b",").strip()
        if text in (b"", b"}"):
            return
        try:
            self.header.update(loads(b"{" + text))
        except _JSONError:
            pass  # metadata after the events is optional; the events are complete
