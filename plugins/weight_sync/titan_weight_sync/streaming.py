"""The trainer's writes: every tensor's bytes streamed through a double-buffered staging buffer.

The staging buffer is split in two halves. Each piece is at most one half: whole small tensors,
or a byte range of a large one, so a tensor of any size goes through a buffer of bounded size.
While one piece is written into the engines (one-sided Mooncake writes to each tensor's slot,
plus the offset of the range) and hashed, the next piece is packed into the other half, converted
to the engine's dtype on the way. Each tensor's digest is fed its ranges in order, so it is the
hash of exactly the bytes that were sent.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from titan_weight_sync import digests, layout

Write = Callable[[list[int], list[int], list[int]], None]
"""Writes ``(local addresses, remote offsets in the landing region, lengths)`` to every engine."""


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of the tensor in ``slot``."""

    index: int
    slot: layout.Slot
    start: int
    end: int


def chunks(slots: list[layout.Slot], limit: int) -> list[list[Chunk]]:
    """Pieces of at most ``limit`` bytes (a multiple of 64): whole tensors where they fit, byte
    ranges of one tensor where it does not (every range starts at a multiple of ``limit``)."""
    pieces: list[list[Chunk]] = [[]]
    used = 0
    for index, slot in enumerate(slots):
        start = 0
        while start < slot.nbytes or (slot.nbytes == 0 and start == 0):
            end = min(slot.nbytes, start + limit)
            size = -(-(end - start) // layout.ALIGN) * layout.ALIGN
            if used and used + size > limit:
                pieces.append([])
                used = 0
            pieces[-1].append(Chunk(index, slot, start, end))
            used += size
            if slot.nbytes == 0:
                break
            start = end
    return [piece for piece in pieces if piece]


class StreamingWriter:
    """Packs, hashes and writes pieces; one piece in flight while the next is packed."""

    def __init__(self, staging: torch.Tensor) -> None:
        half = (staging.numel() // 2) // layout.ALIGN * layout.ALIGN
        if half < layout.ALIGN:
            raise ValueError("the staging buffer is too small to split in two")
        self.staging = staging
        self.half = half
        self._jobs = ThreadPoolExecutor(1, thread_name_prefix="titan-weight-sync-write")
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="titan-weight-sync-hash")

    def run(
        self, slots: list[layout.Slot], tensors: list[torch.Tensor], write: Write
    ) -> list[tuple[str, str]]:
        """Send every tensor; returns ``(name, digest)`` in table order."""
        hashers = [digests.hasher() for _ in slots]
        flats = [t.detach().reshape(-1) for t in tensors]
        pending: Future | None = None
        for number, piece in enumerate(chunks(slots, self.half)):
            base = (number % 2) * self.half
            placed = self._pack(piece, flats, base)
            if pending is not None:
                pending.result()  # the other half is free again, and its hashes are in
            pending = self._jobs.submit(self._send, piece, placed, hashers, write)
        if pending is not None:
            pending.result()
        return [(slot.name, hasher.hexdigest()) for slot, hasher in zip(slots, hashers)]

    def _pack(self, piece: list[Chunk], flats: list[torch.Tensor], base: int) -> list[int]:
        """Copy each chunk into the staging half at ``base`` (converting the dtype); returns
        each chunk's offset in the staging buffer."""
        offsets = []
        at = base
        with torch.no_grad():
            for chunk in piece:
                dtype = layout.DTYPES[chunk.slot.dtype]
                size = torch.empty((), dtype=dtype).element_size()
                count = (chunk.end - chunk.start) // size
                first = chunk.start // size
                target = self.staging[at : at + count * size].view(dtype)
                target.copy_(flats[chunk.index][first : first + count])
                offsets.append(at)
                at += -(-(chunk.end - chunk.start) // layout.ALIGN) * layout.ALIGN
        return offsets

    def _send(
        self, piece: list[Chunk], placed: list[int], hashers: list[digests.Hasher], write: Write
    ) -> None:
        """Write one piece while hashing it (both only read the staging buffer)."""

        def digest() -> None:
            raw = self.staging.numpy()
            for chunk, at in zip(piece, placed):
                hashers[chunk.index].update(memoryview(raw[at : at + chunk.end - chunk.start]))

        hashed = self._hashing.submit(digest)
        base = self.staging.data_ptr()
        sent = [(chunk, at) for chunk, at in zip(piece, placed) if chunk.end > chunk.start]
        try:
            if sent:
                write(
                    [base + at for _, at in sent],
                    [chunk.slot.offset + chunk.start for chunk, _ in sent],
                    [chunk.end - chunk.start for chunk, _ in sent],
                )
        finally:
            hashed.result()

    def close(self) -> None:
        """Stop the worker threads."""
        self._jobs.shutdown(wait=True)
        self._hashing.shutdown(wait=True)
