"""Stream the events of one Kineto (Chrome-trace JSON) file in bounded memory.

The decompressed text is cut into one piece per event at the ``}, {`` boundaries between the
objects of ``traceEvents``.  The native scanner (``_native.c``, built at install where a C
compiler exists) runs the loop below in C and hands GPU events over as tuples of their fields
(``records``); what it cannot vouch for it leaves to this module's loop, which is also the
fallback where it is not built and the reference the tests compare it with.  In that loop, one
regex per piece (run by ``filter``, in C) keeps the GPU ops, launch calls and user annotations.
Launch calls (``cudaLaunchKernel`` ...) are read by two small regexes for their (thread, time,
correlation) without a JSON parse; of the annotations only ``ProfilerStep#N`` and communication
titles (``nccl:send 0->1``, ``gloo:recv``, ``titan.p2p:recv_forward``, ...) are parsed.  Traces
without GPU events are read a second time for their CPU ops.  The CPU-side bulk of a GPU trace
therefore costs one regex search an event.

A piece that fails to parse (a ``}, {`` inside a string) is retried joined with its neighbours;
what still fails is counted in ``drops`` (with its reason: not JSON, or a number beyond the
double range), as is a parsed event holding a string over ``max_string``.  An event's text over
``max_event`` refuses the file as soon as the text read shows it (``framing``), so a
decompressed monster (a 2 GiB string in a 2 MB gzip) costs about ``max_event`` bytes of
inflation, and a file's text is at most (events + HOLD + 1) x ``max_event``.  A file cut short
is read up to its last complete event and flagged ``truncated``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from .drops import MAX_DUR, MAX_TS, Drops, event_kind, piece_kind
from .fastpath import OVERFLOW, Codec, codec, native_scan
from .framing import (
    ARRAY_END,
    MAX_EVENT,
    MAX_STRING,
    MIB,
    SEP,
    TraceError,
    check_size,
    closes,
    header,
    long_string,
    open_array,
    trailer,
)
from .source import INFLATE_CHUNK, Source

__all__ = ["MAX_EVENT", "MAX_STRING", "MIB", "Kernel", "TraceError", "TraceReader"]

# a GPU event read by the native scanner: (cat, ts, dur, name, correlation or None, the JSON text
# of its "args" object or None), the values OpBuilder.gpu_event takes from the parsed dict
Kernel = tuple[str, float, float, str, int | None, bytes | None]

CAT = re.compile(rb'"cat"\s*:\s*"([^"]*)"')
GPU_CATS = (b"kernel", b"gpu_memcpy", b"gpu_memset")
LAUNCH_CATS = (b"cuda_runtime", b"cuda_driver", b"musa_runtime", b"musa_driver")
WANTED = re.compile(
    rb'"cat"\s*:\s*"(?:' + b"|".join((*GPU_CATS, *LAUNCH_CATS, b"user_annotation")) + rb')"'
)
USER_ANNOTATION = b'"user_annotation"'  # not "gpu_user_annotation", the GPU-side copy
STEP_MARK = b"ProfilerStep#"
COMM_MARK = re.compile(rb'"name"\s*:\s*"(?:nccl|gloo|mccl|rccl|hccl|titan\.p2p):')
CPU_CATS = re.compile(rb'"cat"\s*:\s*"(?:cpu_op|user_annotation)"')
# launches only matter for (correlation -> thread, CPU time): three fields, no parse (Kineto
# writes "tid", "ts" and then "args" holding "correlation"; other layouts take the full parse)
LAUNCH = re.compile(
    rb'"tid"\s*:\s*(\d+)\s*,\s*"ts"\s*:\s*(-?[0-9][0-9.eE+-]*)[^{]*\{[^}]*"correlation"\s*:\s*(\d+)'
)
HOLD = 4


class TraceReader:
    """Iterate the wanted events of one trace; ``header`` holds the top-level metadata.

    ``cpu_ops``: also yield every ``cpu_op`` / ``user_annotation`` (CPU-only traces).
    ``native``: use the native scanner in ``records`` (default: when built and not ``pure``).
    ``block``: bytes per file read (default: the source's own sizes).
    ``max_event`` / ``max_string``: the size limits (bytes) of one event's text and of one
    string in a parsed event.
    """

    def __init__(
        self,
        path: str,
        pure: bool = False,
        cpu_ops: bool = False,
        native: bool | None = None,
        block: int | None = None,
        max_event: int = MAX_EVENT,
        max_string: int = MAX_STRING,
    ) -> None:
        self.path, self.block = path, block
        self.max_event, self.max_string = max(1, max_event), max(1, max_string)
        self.codec: Codec = codec(pure)
        self.cpu_ops = cpu_ops
        scan = native_scan(pure)
        if native and scan is None:
            raise TraceError("the native scanner is not built (reinstall with a C compiler)")
        self._scan = scan if native is not False and not cpu_ops else None
        self.native = self._scan is not None  # records() may yield Kernel tuples
        self.header: dict[str, Any] = {}
        self.n_events = 0  # pieces seen: an unparsed event with "}, {" inside counts twice
        self.drops = Drops()  # events dropped here: not JSON, a number or a string too large
        self._source: Source | None = None
        self.launches: dict[int, tuple[float, int]] = {}  # correlation -> (CPU time, thread)
        self.truncated = False
        self.damage: str | None = None

    @property
    def bad_events(self) -> int:
        """Events this reader dropped (see ``drops`` for why)."""
        return self.drops.total()

    @property
    def bytes_read(self) -> int:
        """Bytes of (decompressed) text read so far."""
        return 0 if self._source is None else self._source.bytes_read

    def events(self) -> Iterator[dict[str, Any]]:
        """Yield the wanted events; launch calls go to ``launches`` (or are yielded when their
        fields are not where the fast path looks)."""
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        """The wanted events, one list per chunk of the file (cheaper than one by one)."""
        return self._read(None)  # type: ignore[return-value]

    def records(self) -> Iterator[list[dict[str, Any] | Kernel]]:
        """As ``batches``, but a GPU event the native scanner read comes as a :data:`Kernel`
        tuple of its fields instead of a dict (the analysis's hot path)."""
        return self._read(self._scan)

    def _read(self, scan: Callable | None) -> Iterator[list[dict[str, Any] | Kernel]]:
        src = self._source = Source(
            self.path, self.codec, self.block, min(INFLATE_CHUNK, self.max_event)
        )
        yield from self._batches(iter(src), scan)
        if src.damage or src.truncated:
            self.truncated = True
            self.damage = src.damage or "the gzip stream ends early (file cut off)"

    def _batches(
        self, chunks: Iterator[bytes], scan: Callable | None
    ) -> Iterator[list[dict[str, Any] | Kernel]]:
        buf, start, end = open_array(chunks)
        self.header.update(header(buf[:start], self.codec))
        buf = buf[end:]
        if buf.startswith(b"]"):
            self._trailer(buf[1:])
            return
        if buf and not buf.startswith(b"{"):
            raise TraceError("traceEvents is not an array of event objects")
        buf = buf[1:]
        for chunk in chunks:
            buf += chunk
            if len(buf) > self.max_event:
                check_size(buf, self.max_event, self.bytes_read)
            if scan is not None:
                got = scan(buf, HOLD, self.launches, MAX_TS, MAX_DUR, self.max_string)
                items = None if got is None else self._native(got)
                if items is not None:
                    self.n_events += got[1]
                    yield items
                    buf = buf[got[0] :]
                    continue
                # a piece only the Python loop handles (a parse that needs its neighbours,
                # a launch time float() rejects): it reads this buffer again, with the same
                # results (the launch records written so far are written again, unchanged)
            parts = SEP.split(buf)  # piece, separator, piece, ..., remainder
            # hold the last HOLD pieces back: a rejoin may need them as context
            keep = min(len(parts), 2 * HOLD + 1)
            yield self._parse(parts, (len(parts) - keep + 1) // 2, buf)
            buf = b"".join(parts[len(parts) - keep :])
        yield self._finish(buf)

    def _parse(
        self, parts: list[bytes], limit: int | None = None, text: bytes = b""
    ) -> list[dict[str, Any]]:
        """Events of ``parts`` (piece, separator, piece, ...) among the first ``limit`` pieces;
        ``text`` (the joined parts) is searched at C speed for the rarer pieces."""
        pieces, seps = parts[0::2], parts[1::2]
        n = len(pieces) if limit is None else limit
        out: list[dict[str, Any]] = []
        if n <= 0:
            return out
        self.n_events += n
        head = pieces[:n]
        selected = list(filter(CPU_CATS.search if self.cpu_ops else WANTED.search, head))
        text = text or b"".join(parts)
        if STEP_MARK in text:  # ProfilerStep written as a cpu_op by some versions
            ids = set(map(id, selected))
            selected += [p for p in head if STEP_MARK in p and id(p) not in ids]
        consumed: set[int] = set()
        launches, loads, errors = self.launches, self.codec.loads, self.codec.json_errors
        cpu_ops = self.cpu_ops
        for p in selected:
            # Kineto writes "cat" second: look for the kind near the start first (a miss only
            # costs a full parse, and _read sorts events by their parsed "cat")
            if p.find(b'_runtime"', 0, 96) >= 0 or p.find(b'_driver"', 0, 96) >= 0:
                m = LAUNCH.search(p)
                if m is not None:
                    try:
                        t = float(m[2])
                    except ValueError:  # a time float() refuses ("1e5e"): this event only
                        self.drops.add("ts", "launch")
                        continue
                    if -MAX_TS <= t <= MAX_TS:
                        launches[int(m[3])] = (t, int(m[1]))
                    else:  # "1e999": no time to place its kernels by
                        self.drops.add("ts_range", "launch")
                    continue
            elif not cpu_ops and p.find(USER_ANNOTATION, 0, 96) >= 0:
                if STEP_MARK not in p and COMM_MARK.search(p) is None:
                    continue  # an annotation the analysis does not use
            try:
                ev = loads(b"{" + p + b"}")
                size = len(p)
            except errors as exc:
                i = pieces.index(p)
                if i in consumed:
                    continue
                ev = self._rejoin(pieces, seps, i, consumed)
                if ev is None:
                    why = "number" if OVERFLOW in str(exc) else "unparsable"
                    self.drops.add(why, piece_kind(p))
                    continue
                joined = b"".join(pieces[min(consumed) : max(consumed) + 1])
                if not self._wanted(joined):
                    continue
                size = len(joined)
            if size > self.max_string and self._long_string(ev):
                continue
            out.append(ev)
        return out

    def _long_string(self, ev: dict[str, Any]) -> bool:
        """Whether ``ev`` holds a string over ``max_string`` bytes (then counted as dropped)."""
        if long_string(ev, self.max_string):
            self.drops.add("string", event_kind(ev))
            return True
        return False

    def _native(self, got: tuple[int, int, list, list]) -> list[dict[str, Any] | Kernel] | None:
        """The scanner's items with the pieces it left to Python parsed in place; None when
        one of them does not parse (the Python loop then retries it with its neighbours)."""
        items, loads, errors = got[2], self.codec.loads, self.codec.json_errors
        parsed = []
        for i, piece in got[3]:
            try:
                parsed.append((i, len(piece), loads(b"{" + piece + b"}")))
            except errors:
                return None  # before any drop is counted: the Python loop counts them
        long = False
        for i, size, ev in parsed:
            items[i] = ev
            if size > self.max_string and self._long_string(ev):
                items[i], long = None, True
        return [ev for ev in items if ev is not None] if long else items

    def _wanted(self, piece: bytes) -> bool:
        m = CAT.search(piece)
        if m is None:
            return False
        cat = m.group(1)
        if cat in GPU_CATS or cat in LAUNCH_CATS:
            return True
        if cat in (b"user_annotation", b"cpu_op"):
            return self.cpu_ops or STEP_MARK in piece or COMM_MARK.search(piece) is not None
        return False

    def _rejoin(
        self, pieces: list[bytes], seps: list[bytes], i: int, consumed: set[int]
    ) -> dict[str, Any] | None:
        """Join piece ``i`` with its neighbours until it parses (the cut was inside a string
        or a nested list); the indices used go into ``consumed``."""
        for lo in range(i, max(-1, i - 4), -1):
            for hi in range(i if lo < i else i + 1, min(len(pieces), i + 16)):
                text = pieces[lo] + b"".join(seps[k - 1] + pieces[k] for k in range(lo + 1, hi + 1))
                try:
                    ev = self.codec.loads(b"{" + text + b"}")
                except self.codec.json_errors:
                    continue
                if not isinstance(ev, dict):
                    continue
                consumed.clear()
                consumed.update(range(lo, hi + 1))
                self.n_events -= hi - lo
                return ev
        return None

    def _finish(self, rest: bytes) -> list[dict[str, Any]]:
        # the array's end is the "}]" that the top level's own ending follows (a damaged event in
        # the tail is that event's problem, not a sign that the file was cut)
        for m in ARRAY_END.finditer(rest):
            if closes(rest[m.end() :], self.codec):
                events = self._parse(SEP.split(rest[: m.start()]))
                self._trailer(rest[m.end() :])
                return events
        for m in ARRAY_END.finditer(rest):
            body = rest[: m.start()]
            try:
                self.codec.loads(
                    b"[{" + body + b"}]"
                )  # the held-back tail is whole events: the end
            except self.codec.json_errors:
                continue
            events = self._parse(SEP.split(body))
            self._trailer(rest[m.end() :])
            return events
        # the array never closes: salvage every complete event, drop the cut one
        self.truncated = True
        self.damage = "the traceEvents array never closes (file cut off)"
        parts = SEP.split(rest)
        last = parts[-1]
        try:
            self.codec.loads(b"{" + last.rstrip().rstrip(b",") + b"}")
            complete = len(parts) // 2 + 1
        except self.codec.json_errors:
            complete = len(parts) // 2
        return self._parse(parts, complete)

    def _trailer(self, text: bytes) -> None:
        for key, value in trailer(text, self.codec).items():
            self.header.setdefault(key, value)
