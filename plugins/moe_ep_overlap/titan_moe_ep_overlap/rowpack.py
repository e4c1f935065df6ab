"""Several row-aligned tensors as one byte matrix, so one all-to-all moves them all.

Every collective costs a launch and a synchronisation (a gloo worker hand-off, an NCCL kernel),
so dispatch sends tokens, expert ids, source indices and weights as one ``uint8 [rows, bytes]``
tensor and combine sends outputs and weight gradients together. Parts are 2-D ``[rows, cols]``;
the receiver gets strided views that are copied out (dispatch) or read in place (combine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """Where one part lives in a packed row: byte offset, width in bytes, dtype, columns."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    cols: int


def layout_of(parts: list[torch.Tensor]) -> list[Part]:
    """Byte layout of ``parts`` packed side by side (each part's offset aligned to its itemsize)."""
    layout, offset = [], 0
    for p in parts:
        size = p.element_size()
        offset = -(-offset // size) * size
        nbytes = size * p.shape[1]
        layout.append(Part(offset, nbytes, p.dtype, p.shape[1]))
        offset += nbytes
    return layout


def row_bytes(layout: list[Part]) -> int:
    """Bytes of one packed row, padded so every part's dtype view of the rows is valid."""
    end = max((p.offset + p.nbytes for p in layout), default=0)
    align = max((torch.empty(0, dtype=p.dtype).element_size() for p in layout), default=1)
    return -(-end // align) * align


def pack(parts: list[torch.Tensor], layout: list[Part]) -> torch.Tensor:
    """``uint8 [rows, row_bytes]`` holding ``parts`` side by side."""
    rows = parts[0].shape[0]
    out = torch.empty((rows, row_bytes(layout)), dtype=torch.uint8, device=parts[0].device)
    for p, where in zip(parts, layout):
        out[:, where.offset : where.offset + where.nbytes] = p.contiguous().view(torch.uint8)
    return out


def views(packed: torch.Tensor, layout: list[Part]) -> list[torch.Tensor]:
    """Strided ``[rows, cols]`` views of each part inside a packed matrix (no copy)."""
    return [
        packed[:, w.offset : w.offset + w.nbytes].view(w.dtype).view(packed.shape[0], w.cols)
        for w in layout
    ]
