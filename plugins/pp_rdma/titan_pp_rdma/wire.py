"""The transport's wire format: tensor keys and notification messages.

Every notification is ``(name, msg)`` with ``name = "<session tag>/<sender rank>"`` and ``msg`` one
of (fields joined by ``|``):

- ``R|ch|key``               sender -> receiver: allocate a slot ring for (channel, key)
- ``A|ch|key|a0,a1,...``     receiver -> sender: the ring's slot addresses (all slots are credits)
- ``D|ch|key|seq|slot``      sender -> receiver: message ``seq`` of ``ch`` is in ``slot``
- ``C|ch|key|slot``          receiver -> sender: ``slot`` was copied out, it may be written again
- ``E|text``                 either way: the peer failed; raise ``text`` here too

``ch`` is ``f`` (activations, sent to the next stage) or ``b`` (gradients, sent to the previous
stage). Matching is FIFO per (peer, channel), so with PP=2 (previous == next rank) an activation
can never be taken for a gradient, whatever order the ops were posted in.
"""

from __future__ import annotations

import math

import torch

FWD, BWD = "f", "b"
CHANNEL_NAMES = {FWD: "activation (forward)", BWD: "gradient (backward)"}


def tensor_key(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> str:
    """``"float32:4x2x16"``: the (shape, dtype) a ring is allocated for."""
    return f"{str(dtype).removeprefix('torch.')}:{'x'.join(str(int(d)) for d in shape)}"


def parse_key(key: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Inverse of :func:`tensor_key`."""
    dtype_name, dims = key.split(":", 1)
    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype in tensor key {key!r}")
    return tuple(int(d) for d in dims.split("x") if d), dtype


def key_nbytes(key: str) -> int:
    """Bytes one message of ``key`` occupies."""
    shape, dtype = parse_key(key)
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


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
