"""The trainer's streaming writer, with writes that copy into a local landing region: every
tensor lands whole in its slot, in the engine's dtype, through a staging buffer smaller than the
largest tensor, and each digest is the BLAKE3 of exactly the bytes sent."""

from __future__ import annotations

import ctypes

import pytest
import torch
from blake3 import blake3
from titan_weight_sync import layout
from titan_weight_sync.streaming import StreamingWriter, chunks

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def test_pieces_cover_every_byte_once_and_stay_within_the_limit() -> None:
    slots = layout.build_table(
        [
            ("big", "F32", (1000,)),
            ("small", "BF16", (3,)),
            ("empty", "F32", (0,)),
            ("x", "I8", (70,)),
        ]
    )
    pieces = chunks(slots, 1024)
    for piece in pieces:
        assert sum(-(-(c.end - c.start) // 64) * 64 for c in piece) <= 1024
    covered: dict[str, list[tuple[int, int]]] = {}
    for piece in pieces:
        for c in piece:
            covered.setdefault(c.slot.name, []).append((c.start, c.end))
    assert covered["big"] == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4000)]
    assert (
        covered["small"] == [(0, 6)] and covered["empty"] == [(0, 0)] and covered["x"] == [(0, 70)]
    )


def test_streamed_tensors_land_bit_for_bit_with_their_digests() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(300, 7, generator=generator),  # 8400 B in BF16: larger than a half
        torch.randn(5, generator=generator),
        torch.randint(-100, 100, (33,), dtype=torch.int32, generator=generator),
        torch.zeros(0),
    ]
    slots = layout.build_table(
        [("w", "BF16", (300, 7)), ("b", "F32", (5,)), ("i", "I32", (33,)), ("e", "F32", (0,))]
    )
    landing = torch.zeros(layout.region_bytes(slots), dtype=torch.uint8)
    calls = []

    def write(local: list[int], offsets: list[int], lengths: list[int]) -> None:
        calls.append(len(local))
        for src, offset, length in zip(local, offsets, lengths):
            ctypes.memmove(landing.data_ptr() + offset, src, length)

    writer = StreamingWriter(torch.empty(4096, dtype=torch.uint8))  # two halves of 2 KiB
    try:
        digests = writer.run(slots, tensors, write)
    finally:
        writer.close()
    assert calls == [1, 1, 3]  # the large tensor in ranges of a half, the rest in one piece
    for slot, tensor, (name, digest) in zip(slots, tensors, digests):
        expected = tensor.to(layout.DTYPES[slot.dtype]).contiguous()
        assert name == slot.name
        assert torch.equal(layout.view(landing, slot), expected)
        raw = expected.view(torch.uint8).reshape(-1).numpy().tobytes()
        assert digest == blake3(raw).hexdigest()  # the reference implementation, in one call
