"""The transport's control messages and tensor keys.

Records travel in authenticated frames (``channel.py``); each is ``|``-joined text fields,
optionally followed by a binary payload:

- ``I|ch|key|seq`` + bytes   sender -> receiver: a small tensor, inline (no Mooncake transfer)
- ``M|base|nbytes``          sender -> receiver: memory registered for this session; announces
                             must point into such a region
- ``S|ch|key|seq|addr``      sender -> receiver: the tensor's bytes wait at ``addr``; read them
- ``F|ch|seq``               receiver -> sender: read done, the memory may be reused
- ``U|base``                 sender -> receiver: region ``base`` is unregistered
- ``E|text``                 either way: the peer failed; raise ``text`` here too
- ``T|ns``                   (profiling only) the frame's send time

``ch`` is ``f`` (activations, sent to the next stage) or ``b`` (gradients, sent to the previous
stage). Matching is by (peer, channel, sequence number), so with PP=2 (previous == next rank) an
activation can never be taken for a gradient, whatever order the ops were posted in.
"""

from __future__ import annotations

import functools
import math

import torch

FWD, BWD = "f", "b"
CHANNELS = (FWD, BWD)
CHANNEL_NAMES = {FWD: "activation (forward)", BWD: "gradient (backward)"}
MAX_DIMS = 16
MAX_TENSOR_BYTES = 1 << 40
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    )
}


_SIZES = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES.values()}


@functools.lru_cache(maxsize=256)
def tensor_key(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> str:
    """``"float32:4x2x16"``: the (shape, dtype) a message carries."""
    return f"{str(dtype).removeprefix('torch.')}:{'x'.join(str(int(d)) for d in shape)}"


@functools.lru_cache(maxsize=256)
def parse_key(key: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Inverse of :func:`tensor_key`; ``ValueError`` for anything that is not a sane key."""
    dtype_name, _, dims = key.partition(":")
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"unknown dtype in tensor key {key[:80]!r}")
    shape = tuple(int(d) for d in dims.split("x") if d) if dims else ()
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"bad shape in tensor key {key[:80]!r}")
    if math.prod(shape) * _SIZES[dtype] > MAX_TENSOR_BYTES:
        raise ValueError(f"tensor key {key[:80]!r} is larger than {MAX_TENSOR_BYTES} B")
    return shape, dtype


def key_nbytes(key: str) -> int:
    """Bytes one message of ``key`` occupies."""
    shape, dtype = parse_key(key)
    return math.prod(shape) * _SIZES[dtype]


def describe_key(key: str) -> str:
    """Human form for errors: ``shape (4, 2, 16) dtype torch.float32``."""
    shape, dtype = parse_key(key)
    return f"shape {tuple(shape)} dtype {dtype}"


def encode(*fields: object) -> str:
    """Join message fields."""
    return "|".join(str(f) for f in fields)


def decode(msg: str) -> list[str]:
    """Split a message into its fields (``E`` keeps its text whole)."""
    if msg.startswith("E|"):
        return ["E", msg[2:]]
    return msg.split("|")
