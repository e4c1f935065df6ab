"""The saved-tensor offloader: ``saved_tensors_hooks`` pushed around selected module forwards
hand what autograd saves to a host pool, and bring it back block by block in the order backward
needs it.

Granularity: a *block* is one forward of a selected module (attention, MoE layer, ...) of one
unit (chunk, microbatch). Tensors are staged while the block runs and copied when it ends (so
the copy overlaps the next block's compute on a GPU); during backward, the first unpack from a
block triggers the reload of the next ``prefetch_blocks`` blocks. The copies themselves are
:class:`~titan_act_offload.transfers.HostCopies`'s job.

What counts as an activation: a saved tensor with a ``grad_fn``, or one its owner marked with
``titan_plugins.saved_tensors.mark_activation`` (e.g. fp8_blockwise's FP8 input copies and
scales, made inside an autograd Function's forward, so without a ``grad_fn``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from titan_act_offload.accounting import OffloadStats
from titan_act_offload.host_pool import HostBufferPool
from titan_act_offload.plan import Unit
from titan_act_offload.records import (
    HOST,
    KEPT,
    STAGED,
    Block,
    Handle,
    Record,
    UnitState,
    dense_base,
    dense_span,
)
from titan_act_offload.settings import OffloadSettings
from titan_act_offload.transfers import HostCopies
from titan_plugins.saved_tensors import is_activation

_hooks = torch._C._autograd
# Skipped saves that are model state, not activations: the stage's figures leave them out.
_NOT_ACTIVATIONS = frozenset({"parameter_or_subclass", "parameter_view"})


_F = TypeVar("_F", bound=Callable[..., Any])


def _no_torch_function(method: _F) -> _F:
    """Run ``method`` with every ``__torch_function__`` override off (modes and subclasses).

    The hooks read tensor metadata and copy storages: none of it is a model op a mode of the
    user's (a device shim, a FLOP counter) should see or rewrite, and under a Python mode each
    call pays its dispatch (six metadata reads: 5.1 us instead of 0.6 us; ~4,400 such calls per
    step in the CPU benchmark, whose harness maps CUDA to CPU with one). Subclass tensors never
    get here: the pack hook leaves them to autograd untouched.
    """

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return method(*args, **kwargs)

    return run  # type: ignore[return-value]


class Offloader:
    """Per-process offload engine. ``platform`` is ``titan_plugins.platform`` (or a stand-in)."""

    def __init__(self, settings: OffloadSettings, platform: Any) -> None:
        self.settings = settings
        self.device_type = platform.device_type()
        self.stats = OffloadStats()
        self.pool = HostBufferPool(settings.max_host_bytes, pin=platform.pin_memory_supported())
        self.copies = HostCopies(platform, self.stats, self.pool)
        self.current: UnitState | None = None
        self.param_storages: frozenset[int] = frozenset()
        self._pack_count = 0

    def report(self) -> dict[str, Any]:
        """The byte counters (``OffloadStats.as_dict``) and the host pool's counters."""
        return {"stats": self.stats.as_dict(), "host_pool": self.pool.stats()}

    # ----- units -------------------------------------------------------------------------
    def begin_unit(self, unit: Unit, offload: bool, exclude: frozenset[int]) -> UnitState:
        """Start the forward of ``unit``; tensors saved in selected blocks now belong to it.

        Saves made outside the selected blocks are watched too (kept on the device, counted in
        the stage's figures) when our hooks can sit at the bottom of the forward.
        """
        state = UnitState(unit, offload and not self.settings.dry_run, exclude)
        self.current = state
        if self._may_push():
            state.open.append(Block("outside", state, outside=True))
            state.watching = True
            _hooks._push_saved_tensors_default_hooks(self.pack, self.unpack)
        return state

    def end_unit_forward(self, state: UnitState) -> None:
        """The unit's forward returned: later saves are not its own."""
        if state.watching:
            state.watching = False
            _hooks._pop_saved_tensors_default_hooks()
        state.dedupe.clear()
        state.open.clear()
        # Backward reaches a block first where it saved last: order blocks by their last save.
        order = sorted((b for b in state.blocks if b.records), key=lambda b: -b.last_pack)
        for position, block in enumerate(order):
            block.position = position
        state.backward = order
        if self.current is state:
            self.current = None

    def end_unit_backward(self, state: UnitState) -> None:
        """The unit's backward ran: the saved tensors it left in place are released."""
        self.stats.unpin(sum(state.pinned.values()))
        state.pinned.clear()

    @_no_torch_function
    def prefetch_unit(self, state: UnitState) -> None:
        """Reload the first blocks backward will need (called by the plan ahead of backward)."""
        for block in state.backward[: self.settings.prefetch_blocks]:
            self.copies.reload(block, prefetch=True)

    # ----- blocks (module forwards) ----------------------------------------------------------
    def enter_block(self, name: str) -> Block | None:
        """Push our hooks for a module forward, or return None when the saves are not ours."""
        state = self.current
        if state is None or not self._may_push():
            return None
        block = Block(name, state)
        state.open.append(block)
        _hooks._push_saved_tensors_default_hooks(self.pack, self.unpack)
        return block

    def _may_push(self) -> bool:
        """Whether saves made now are ours to take (see the reasons below)."""
        if not torch.is_grad_enabled():
            return False
        if torch._C._current_graph_task_id() != -1:
            return False  # recomputation inside backward: saves are consumed at once
        if not _hooks._saved_tensors_hooks_is_enabled():
            return False  # disabled by the caller (e.g. functorch transforms)
        top = _hooks._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] != self.pack:
            self.stats.skip("other_saved_tensors_hooks", 0)
            return False  # another hook (TE/megatron offload, checkpoint) owns these saves
        return True

    @_no_torch_function
    def exit_block(self, block: Block) -> None:
        """Pop our hooks; the block's staged tensors go to host if its unit is offloaded."""
        _hooks._pop_saved_tensors_default_hooks()
        state = block.unit
        if state.open and state.open[-1] is block:
            state.open.pop()
        state.blocks.append(block)
        block_bytes = sum(r.nbytes for r in block.records)
        self.stats.max_block_bytes = max(self.stats.max_block_bytes, block_bytes)
        if state.offload:
            if self.settings.min_bytes is None:
                self._keep_smallest(block, block_bytes * self.settings.keep_fraction)
            self.copies.offload(block)
        self.copies.poll()

    def _keep_smallest(self, block: Block, allowance: float) -> None:
        """Relative size rule: the smallest tensors stay while they sum to ``allowance`` bytes
        (copying them would cost a transfer each and save almost nothing)."""
        kept = 0
        for record in sorted((r for r in block.records if r.state == STAGED), key=_size):
            if kept + record.nbytes > allowance:
                return
            kept += record.nbytes
            self.copies.keep(record, "small")

    # ----- saved tensor hooks ----------------------------------------------------------------
    def skip_reason(self, tensor: torch.Tensor) -> str | None:
        """Why a saved tensor stays with autograd untouched (None: we manage it)."""
        if type(tensor) is not torch.Tensor:
            return "parameter_or_subclass"
        if not is_activation(tensor):
            return "leaf"  # no grad_fn and not marked: parameters, inputs, constants, caches
        if tensor.layout != torch.strided or tensor.device.type != self.device_type:
            return "not_device_strided"
        if tensor.numel() == 0:
            return "empty"  # e.g. the input of an expert that got no tokens
        minimum = self.settings.min_bytes
        if minimum and tensor.numel() * tensor.element_size() < minimum:
            return "small"
        storage = tensor.untyped_storage().data_ptr()
        if storage in self.param_storages:
            return "parameter_view"
        if self.current is not None and storage in self.current.exclude:
            return "stage_input"
        if not dense_span(tensor):
            return "not_dense"
        return None

    @_no_torch_function
    def pack(self, tensor: torch.Tensor) -> Any:
        """Pack hook: register the tensor with the current block."""
        state = self.current
        if state is None or not state.open:
            return tensor
        reason = self.skip_reason(tensor)
        view = None
        if reason == "not_dense" and (base := dense_base(tensor)) is not None:
            # Manage the view's dense base (views of it in this unit share one record).
            offset = tensor.storage_offset() - base.storage_offset()
            view, tensor, reason = (tuple(tensor.shape), tensor.stride(), offset), base, None
        if reason is not None:
            held = _held_bytes(tensor)
            self.stats.skip(reason, held)
            if reason not in _NOT_ACTIVATIONS:
                storage = tensor.untyped_storage().data_ptr()
                if storage not in state.pinned:
                    state.pinned[storage] = held
                    self.stats.pin(held)
            return tensor
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        hit = state.dedupe.get(key)
        if hit is not None and hit[0]() is not None and hit[1].device is not None:
            record = hit[1]
            record.pending += 1
            record.handles += 1
            self._stamp(state.open[-1])
            return Handle(record, self, view)
        block = state.open[-1]
        self._stamp(block)
        record = Record(tensor, block)
        block.records.append(record)
        state.dedupe[key] = (weakref.ref(tensor), record)
        if not block.outside:
            state.saved += record.nbytes
        self.stats.saved(record)
        kept = block.outside or not state.offload
        if kept:
            record.state = KEPT
        self.stats.enter(record, kept=kept)
        return Handle(record, self, view)

    @_no_torch_function
    def unpack(self, packed: Any) -> torch.Tensor:
        """Unpack hook: hand the (reloaded) tensor to autograd."""
        if not isinstance(packed, Handle):
            return packed
        record = packed.record
        block = record.block
        if not block.touched:
            block.touched = True
            if block.prefetched:
                self.stats.prefetch_hits += 1
            elif any(r.state == HOST for r in block.records):
                self.stats.late_reloads += 1
                self.copies.reload(block, prefetch=False)
            self._prefetch_after(block)
        if record.state == HOST:  # shared with a block that was reloaded without it
            self.copies.reload(block, prefetch=False, force=True)
        tensor = record.device
        assert tensor is not None, "act_offload: saved tensor released before backward used it"
        if packed.view is not None:
            size, stride, offset = packed.view
            tensor = tensor.as_strided(size, stride, tensor.storage_offset() + offset)
        self.copies.wait_reloaded(record, tensor)
        record.pending -= 1
        if record.pending == 0:
            self.stats.end_of_life(record)  # autograd owns it from here
            self.copies.release_host(record)
        return tensor

    def drop_handle(self, record: Record) -> None:
        """A SavedVariable died: release the record once nothing points to it."""
        record.handles -= 1
        if record.handles == 0:
            self.stats.end_of_life(record)
            if record.state != HOST or record.done_event is None:
                self.copies.release_host(record)
            record.device = None

    def _prefetch_after(self, block: Block) -> None:
        if block.position < 0:
            return  # unpacked before its unit's forward ended: no order yet
        start = block.position + 1
        for following in block.unit.backward[start : start + self.settings.prefetch_blocks]:
            self.copies.reload(following, prefetch=True)

    def _stamp(self, block: Block) -> None:
        self._pack_count += 1
        block.last_pack = self._pack_count

    # ----- step boundaries -------------------------------------------------------------------
    def poll(self) -> None:
        """Release device copies whose device-to-host copy has completed (GPU)."""
        self.copies.poll()

    def synchronize(self) -> None:
        """Wait for every copy in flight (end of a step)."""
        self.copies.synchronize()


def _size(record: Record) -> int:
    return record.nbytes


def _held_bytes(tensor: torch.Tensor) -> int:
    """Bytes a saved tensor keeps alive: its elements, or less when it is a broadcast view of a
    smaller storage (an ``expand``ed index holds only its storage)."""
    nbytes = tensor.numel() * tensor.element_size()
    try:
        return min(nbytes, tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # storage-less tensors (sparse, subclasses)
        return nbytes
