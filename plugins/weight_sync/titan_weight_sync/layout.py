"""Where each weight lands in an engine: the table of the checkpoint the engine loaded.

The engine publishes the Hugging Face names, dtypes and shapes of the checkpoint it serves (read
from the safetensors headers of its model directory: what SGLang's own loader consumed), each at
an offset in one landing region. A trainer must send exactly these tensors; anything else (a
name the engine does not know, a wrong shape or dtype, a missing tensor) is refused before a
byte moves. SGLang's own ``load_weights`` then fuses and shards them (qkv, gate_up, experts).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 64
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Slot:
    """One tensor's place in the landing region."""

    name: str
    dtype: str  # safetensors name: BF16, F32...
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


def build_table(entries: list[tuple[str, str, tuple[int, ...]]]) -> list[Slot]:
    """Slots for ``(name, dtype, shape)`` entries, in order, each aligned to 64 bytes."""
    slots: list[Slot] = []
    offset = 0
    for name, dtype, shape in entries:
        slot = Slot(name, dtype, tuple(shape), offset)
        slots.append(slot)
        offset += -(-slot.nbytes // ALIGN) * ALIGN
    return slots


def region_bytes(slots: list[Slot]) -> int:
    """Bytes the landing region needs for ``slots``."""
    if not slots:
        return 0
    last = slots[-1]
    return -(-(last.offset + last.nbytes) // ALIGN) * ALIGN


def checkpoint_table(model_dir: str) -> list[Slot]:
    """The landing table of the safetensors checkpoint in ``model_dir`` (headers only).

    :raises ValueError: not a local directory with ``*.safetensors`` files, or a malformed header.
    """
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ValueError(
            f"weight_sync: {model_dir!r} is not a local directory with *.safetensors files; the "
            "engine must serve a local checkpoint for weight_sync to know its tensors"
        )
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    for path in files:
        for name, info in _header(path).items():
            if name == "__metadata__":
                continue
            dtype, shape = info.get("dtype"), info.get("shape")
            if dtype not in DTYPES or not isinstance(shape, list):
                raise ValueError(f"weight_sync: {path}: tensor {name!r} has dtype {dtype!r}")
            entries.append((name, dtype, tuple(int(s) for s in shape)))
    entries.sort(key=lambda e: e[0])
    return build_table(entries)


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(MAX_HEADER_BYTES, os.path.getsize(path)):
            raise ValueError(f"weight_sync: {path}: safetensors header of {length} bytes")
        return json.loads(f.read(length))


def view(region: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor ``slot`` describes, as a view of the landing ``region`` (uint8)."""
    raw = region[slot.offset : slot.offset + slot.nbytes]
    return raw.view(DTYPES[slot.dtype]).view(slot.shape)
