"""SHA-256 of tensors' bytes, on both sides (the commit's proof that the landed bytes are the
trainer's). hashlib releases the GIL on large buffers, so tensors hash on a few threads."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

_WORKERS = max(1, min(4, os.cpu_count() or 1))


def sha256(tensor: torch.Tensor) -> str:
    """Hex SHA-256 of a contiguous CPU tensor's bytes."""
    raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


def sha256_all(tensors: Iterable[torch.Tensor]) -> list[str]:
    """:func:`sha256` of each tensor, in order, on up to 4 threads."""
    with ThreadPoolExecutor(_WORKERS) as pool:
        return list(pool.map(sha256, tensors))
