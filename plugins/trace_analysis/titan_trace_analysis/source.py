"""The decompressed bytes of one trace file, in chunks, salvaging what a damaged file holds.

A gzip stream cut short (a copy interrupted, a job killed while the profiler wrote) or damaged
in the middle still yields every byte inflated before the damage; ``truncated`` / ``damage``
say what happened so the reader can mark the rank partial instead of discarding it.
Concatenated gzip members are read one after the other.  No read inflates more than
``INFLATE_CHUNK`` bytes at once (deflate packs up to ~1000 bytes of text in one), so the reader's
limits stop a decompression bomb within a chunk of them; ``bytes_read`` counts the text handed
out.
"""

from __future__ import annotations

from collections.abc import Iterator

from .fastpath import Codec

RAW_BLOCK = 64 << 10  # compressed bytes per read: ~0.5 MB of text, cache-friendly to split
PLAIN_BLOCK = 512 << 10
GZIP = 31  # zlib wbits for a gzip header and trailer
INFLATE_CHUNK = 4 << 20  # text bytes per inflate call at most (a usual read gives ~0.6 MB)


class Source:
    """Iterate the decompressed content of ``path`` (plain or gzip)."""

    def __init__(
        self, path: str, codec: Codec, block: int | None = None, chunk: int = INFLATE_CHUNK
    ) -> None:
        # block: bytes per read of either kind (tests use small ones to cut events across reads)
        self.path, self.codec, self.block, self.chunk = path, codec, block, max(1, chunk)
        self.bytes_read = 0  # (decompressed) bytes handed out so far
        self.truncated = False  # the compressed stream ended early
        self.damage: str | None = None  # why inflation stopped before the end

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as fh:
            first = fh.read(self.block or RAW_BLOCK)
            if first[:2] != b"\x1f\x8b":
                while first:
                    self.bytes_read += len(first)
                    yield first
                    first = fh.read(self.block or PLAIN_BLOCK)
                return
            yield from self._inflate(fh, first)

    def _inflate(self, fh, data: bytes) -> Iterator[bytes]:
        d = self.codec.decompressobj(GZIP)
        started = False
        while True:
            try:
                out = d.decompress(data, self.chunk)
            except self.codec.inflate_errors as exc:
                self.damage = f"corrupt gzip data ({exc})"
                return
            started = True
            if out:
                self.bytes_read += len(out)
                yield out
            if d.eof:
                rest = d.unused_data
                if rest.strip(b"\x00"):
                    d = self.codec.decompressobj(GZIP)  # another gzip member follows
                    data = rest
                    continue
            elif d.unconsumed_tail or len(out) == self.chunk:
                data = d.unconsumed_tail  # more text from the input already read
                continue
            data = fh.read(self.block or RAW_BLOCK)
            if not data:
                break
        if started and not d.eof:
            self.truncated = True
