"""Digests of tensors' bytes, on both sides: the commit's proof that the landed bytes are the
trainer's.

BLAKE3 (256-bit, collision resistant like SHA-256): every byte of every update is hashed once by
the trainer and once by each engine, so the hash runs at the speed of the update. Here it hashes
about 4.5 GB/s on one core against SHA-256's 1.2 GB/s (both with the CPU's SIMD / SHA
extensions), and it releases the GIL, so tensors hash on a few threads while Python goes on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from titan_weight_sync.errors import WeightSyncError

ALGORITHM = "blake3"
"""What the hello names, so a trainer refuses an engine that checks with another hash."""
_WORKERS = max(1, min(4, os.cpu_count() or 1))


class Hasher(Protocol):
    """An incremental digest (fed a tensor's byte ranges in order)."""

    def update(self, data: memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def require() -> Callable[..., Hasher]:
    """The BLAKE3 constructor.

    :raises WeightSyncError: the ``blake3`` package is missing (an install with ``--no-deps``),
        naming the fix; the caller falls back to the framework's own path.
    """
    try:
        from blake3 import blake3
    except ImportError as err:
        raise WeightSyncError(
            f"weight_sync: the blake3 package is not installed here ({err}): pip install "
            "blake3==1.0.11 (a dependency of titan-weight-sync that an install with --no-deps "
            "leaves out)"
        ) from None
    return blake3


def hasher() -> Hasher:
    """A fresh incremental digest of :data:`ALGORITHM`."""
    return require()()


def digest(tensor: torch.Tensor) -> str:
    """Hex digest of a contiguous CPU tensor's bytes."""
    raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
    return require()(memoryview(raw)).hexdigest()


def digest_all(tensors: Iterable[torch.Tensor]) -> list[str]:
    """:func:`digest` of each tensor, in order, on up to 4 threads."""
    with ThreadPoolExecutor(_WORKERS) as pool:
        return list(pool.map(digest, tensors))
