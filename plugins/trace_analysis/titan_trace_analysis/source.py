"""The decompressed bytes of one trace file, in chunks, salvaging what a damaged file holds.

A gzip stream cut short (a copy interrupted, a job killed while the profiler wrote) or damaged
in the middle still yields every byte inflated before the damage; ``truncated`` / ``damage``
say what happened so the reader can mark the rank partial instead of discarding it.
Concatenated gzip members are read one after the other.
"""

from __future__ import annotations

from collections.abc import Iterator

from .fastpath import Codec

RAW_BLOCK = 64 << 10  # compressed bytes per read: ~0.5 MB of text, cache-friendly to split
PLAIN_BLOCK = 512 << 10
GZIP = 31  # zlib wbits for a gzip header and trailer


class Source:
    """Iterate the decompressed content of ``path`` (plain or gzip)."""

    def __init__(self, path: str, codec: Codec, block: int | None = None) -> None:
        # block: bytes per read of either kind (tests use small ones to cut events across reads)
        self.path, self.codec, self.block = path, codec, block
        self.truncated = False  # the compressed stream ended early
        self.damage: str | None = None  # why inflation stopped before the end

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as fh:
            first = fh.read(self.block or RAW_BLOCK)
            if first[:2] != b"\x1f\x8b":
                while first:
                    yield first
                    first = fh.read(self.block or PLAIN_BLOCK)
                return
            yield from self._inflate(fh, first)

    def _inflate(self, fh, data: bytes) -> Iterator[bytes]:
        d = self.codec.decompressobj(GZIP)
        started = False
        while data:
            try:
                out = d.decompress(data)
            except self.codec.inflate_errors as exc:
                self.damage = f"corrupt gzip data ({exc})"
                return
            started = True
            if out:
                yield out
            rest = d.unused_data if d.eof else b""
            if d.eof and rest.strip(b"\x00"):
                d = self.codec.decompressobj(GZIP)  # another gzip member follows
                data = rest
                continue
            data = fh.read(self.block or RAW_BLOCK)
        if started and not d.eof:
            self.truncated = True
