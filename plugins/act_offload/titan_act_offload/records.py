"""Bookkeeping objects of the offloader: one record per saved tensor, one block per forward of a
selected module inside a unit, one unit state per (chunk, microbatch) forward."""

from __future__ import annotations

from typing import Any

import torch

from titan_act_offload.plan import Unit

# Record states.
STAGED = "staged"  # on the device, waiting for its block to end before the copy to host
KEPT = "kept"  # stays on the device (unit not offloaded, or not offloadable)
HOST = "host"  # copied to host (device copy released once the copy completed)
RELOADED = "reloaded"  # back on the device, not yet handed to autograd
EXTERNAL = "external"  # storage released by someone else (megatron's CheckpointWithoutOutput)


class Record:
    """One distinct saved tensor (deduplicated within a unit)."""

    __slots__ = (
        "block",
        "device",
        "host_buffer",
        "nbytes",
        "size",
        "stride",
        "dtype",
        "version",
        "state",
        "pending",
        "handles",
        "resident",
        "kept",
        "live",
        "done_event",
    )

    def __init__(self, tensor: torch.Tensor, block: Block) -> None:
        self.block = block
        # detach(): a new TensorImpl on the same storage, immune to megatron's `out.data = ...`
        # pseudo-free of pipeline outputs, and without a grad_fn reference cycle.
        self.device: torch.Tensor | None = tensor.detach()
        self.host_buffer: torch.Tensor | None = None
        self.nbytes = tensor.numel() * tensor.element_size()
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.dtype = tensor.dtype
        self.version = tensor._version
        self.state = STAGED
        self.pending = 1  # unpacks still expected (one per pack)
        self.handles = 1  # live handles (autograd SavedVariables) pointing here
        self.resident = False  # counted in OffloadStats.resident
        self.kept = False  # counted in OffloadStats.kept (not headed to host)
        self.live = True  # counted in OffloadStats.live until its last use
        self.done_event: Any = None

    def host_view(self) -> torch.Tensor:
        """The host buffer seen as a tensor with the original size, stride and dtype."""
        assert self.host_buffer is not None
        flat = self.host_buffer[: self.nbytes].view(self.dtype)
        return flat.as_strided(self.size, self.stride)


class Handle:
    """What the pack hook gives autograd; dropping the last one releases the record.

    ``view``: the saved tensor was a non-dense view of the record's (dense) base tensor, as
    ``(size, stride, storage offset relative to the base)``; unpack rebuilds it on the base.
    """

    __slots__ = ("record", "owner", "view")

    def __init__(self, record: Record, owner: Any, view: tuple | None = None) -> None:
        self.record = record
        self.owner = owner
        self.view = view

    def __del__(self) -> None:
        try:
            self.owner.drop_handle(self.record)
        except Exception:  # interpreter shutdown: nothing left to account
            pass


class Block:
    """Saved tensors of one forward of a selected module (the offload/reload granule), or, with
    ``outside``, what the unit's forward saved outside every selected module (norms, embedding,
    loss: never moved, only accounted)."""

    __slots__ = (
        "name",
        "outside",
        "unit",
        "records",
        "position",
        "last_pack",
        "reloaded",
        "prefetched",
        "touched",
        "reload_event",
    )

    def __init__(self, name: str, unit: UnitState, outside: bool = False) -> None:
        self.name = name
        self.outside = outside
        self.unit = unit
        self.records: list[Record] = []
        self.position = -1  # index in unit.backward once the unit's forward ended
        self.last_pack = 0  # sequence number of the last save into this block
        self.reloaded = False
        self.prefetched = False
        self.touched = False  # backward already unpacked from this block
        self.reload_event: Any = None


class UnitState:
    """Offloader state of one unit between its forward and its backward."""

    __slots__ = (
        "unit",
        "offload",
        "blocks",
        "backward",
        "open",
        "dedupe",
        "saved",
        "exclude",
        "watching",
        "pinned",
    )

    def __init__(self, unit: Unit, offload: bool, exclude: frozenset[int] = frozenset()) -> None:
        self.unit = unit
        self.offload = offload
        self.blocks: list[Block] = []  # closed blocks, in the order they ended
        self.backward: list[Block] = []  # blocks with saves, in the order backward needs them
        self.open: list[Block] = []  # blocks being run (nested modules; the outside one first)
        self.dedupe: dict[tuple, tuple[Any, Record]] = {}
        self.saved = 0  # distinct saved bytes in selected blocks
        self.exclude = exclude  # storages the schedule keeps alive anyway (stage inputs)
        self.watching = False  # our hooks are pushed for the whole forward (outside block)
        self.pinned: dict[int, int] = {}  # storage -> bytes of saved tensors left in place


def dense_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The dense tensor a non-dense view was taken from, or None.

    Without offload, a saved view keeps its whole storage alive (e.g. attention's q, k and v,
    strided slices of the fused QKV projection): moving the base moves exactly that memory.
    """
    base = tensor._base
    if base is None or base.dtype != tensor.dtype or type(base) is not torch.Tensor:
        return None
    if base.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        return None
    return base if dense_span(base) else None


def dense_span(tensor: torch.Tensor) -> bool:
    """True if the tensor covers its storage span exactly once (contiguous up to a permutation),
    so a same-stride copy of ``numel`` elements reproduces it bit for bit, strides included."""
    if tensor.is_contiguous():
        return True
    expected = 1
    dims = sorted((st, s) for s, st in zip(tensor.shape, tensor.stride()) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
