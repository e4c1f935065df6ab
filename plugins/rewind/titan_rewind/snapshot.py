"""A host-memory snapshot of one rank's training state, and its bit-exact restore.

Host buffers are allocated once per slot (pinned when there is an accelerator) and reused.
On a GPU, model params, fp32 main params and optimizer state are copied on a side stream that
first waits for the current one, so the copy overlaps the next forward and backward; the next
optimizer step (the first writer of those tensors) waits for it (:meth:`Slot.fence`). Buffers
and the grad scaler change during the next forward, so they are copied in order on the current
stream. On CPU every copy is a synchronous memcpy through the same code.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_plugins import platform
from titan_rewind import state as _state

RANDOM = "megatron.core.tensor_parallel.random"
START = -1  # the step label of the starting state: before step 0 updated anything


class RestoreError(RuntimeError):
    """The live model or optimizer no longer matches the snapshot (shapes or layout changed)."""


@dataclass
class RngState:
    """torch's CPU generator, the accelerator's generator, and megatron's tracker states."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, Any] | None


def capture_rng() -> RngState:
    """Copy the RNG states (small, on the host already)."""
    module = platform.device_module()
    device = module.get_rng_state() if module is not None else None
    tracker = None
    random = sys.modules.get(RANDOM)
    if random is not None:
        tracker = {}
        for name, value in random.get_cuda_rng_tracker().get_states().items():
            tracker[name] = (
                value.get_state() if isinstance(value, torch.Generator) else value.clone()
            )
    return RngState(torch.get_rng_state(), device, tracker)


def restore_rng(rng: RngState) -> None:
    """Put the RNG states back (generator objects of a graph-safe tracker keep their identity)."""
    torch.set_rng_state(rng.cpu)
    module = platform.device_module()
    if module is not None and rng.device is not None:
        module.set_rng_state(rng.device)
    random = sys.modules.get(RANDOM)
    if random is not None and rng.tracker is not None:
        tracker = random.get_cuda_rng_tracker()
        live = tracker.get_states()
        states = {}
        for name, saved in rng.tracker.items():
            current = live.get(name)
            if isinstance(current, torch.Generator):
                current.set_state(saved)
                states[name] = current
            else:
                states[name] = saved.clone()
        tracker.set_states(states)


@dataclass
class Early:
    """What the starting-state snapshot takes before the first forward of the first training
    call: the non-parameter buffers (MoE token counters and expert bias change during the
    forward-backward) and the RNG states (dropout draws from them). Parameters, fp32 masters and
    optimizer state are unchanged until the first update and are taken just before it."""

    buffers: dict[str, torch.Tensor]
    rng: RngState


def capture_early(chunks: list[Any]) -> Early:
    """Copy the buffers (on their device: small) and the RNG states, before the forward."""
    collected = _state.collect(chunks, None)
    buffers = {
        e.name: e.tensor.detach().clone() for e in collected.entries if e.kind == _state.SMALL
    }
    return Early(buffers, capture_rng())


@dataclass
class Slot:
    """One snapshot: host tensors plus the plain values needed to rebuild the state.

    :param step: index of the training step after which it was taken; ``START`` (-1): the
        starting state, before the first update.
    :param healthy_after: healthy steps seen since it was taken.
    """

    step: int = -1
    taken: bool = False  # whether it holds a snapshot
    healthy_after: int = 0
    mark: int = 0  # the owner's counter at capture (rewind: microbatches read so far)
    taken_at: float = 0.0
    host: list[torch.Tensor] = field(default_factory=list)
    signature: list[Any] = field(default_factory=list)
    plans: list[Any] = field(default_factory=list)
    group_steps: list[Any] = field(default_factory=list)
    scalers: list[Any] = field(default_factory=list)
    rng: RngState | None = None
    events: list[Any] = field(default_factory=list)
    capture_seconds: float = 0.0

    @property
    def empty(self) -> bool:
        """Whether it holds no snapshot."""
        return not self.taken

    @property
    def start(self) -> bool:
        """Whether it holds the starting state."""
        return self.taken and self.step == START

    def label(self) -> str:
        """``the starting state (before step 0)`` / ``the snapshot of step 12``."""
        return (
            "the starting state (before step 0)"
            if self.start
            else f"the snapshot of step {self.step}"
        )

    def nbytes(self) -> int:
        """Host bytes of its buffers."""
        return sum(t.numel() * t.element_size() for t in self.host)

    def clear(self) -> None:
        """Forget the snapshot (the buffers are kept for reuse)."""
        self.step, self.taken, self.healthy_after = -1, False, 0

    def fence(self) -> None:
        """Make the current stream wait for this slot's copies (before tensors are written)."""
        stream = platform.current_stream()
        for event in self.events:
            stream.wait_event(event)

    def synchronize(self) -> None:
        """Block the host until this slot's copies are complete (before reading the host)."""
        for event in self.events:
            event.synchronize()
        self.events = []


def planned_bytes(chunks: list[Any], optimizer: Any) -> int:
    """Host bytes one snapshot of this state needs."""
    return plan(chunks, optimizer)[0]


def plan(chunks: list[Any], optimizer: Any) -> tuple[int, int, bool]:
    """Host bytes of one snapshot of this state now; the bytes it will need once every optimized
    parameter has its optimizer state; and whether that second figure is exact.

    Before the first update torch has created no optimizer state yet. For Adam-type optimizers
    (torch Adam / AdamW, TE and Apex FusedAdam) it is estimated as torch creates it: two moments
    of the parameter's size and dtype and a 4-byte step count per parameter. For any other
    optimizer with missing state the figure is the current one, a lower bound (exact: False).
    """
    collected = _state.collect(chunks, optimizer)
    extra, plans, *_ = _state.collect_optimizer_state(collected)
    now = collected.nbytes() + sum(e.tensor.numel() * e.tensor.element_size() for e in extra)
    full, exact = now, True
    for record, per_param in zip(collected.optimizers, plans):
        adam = "adam" in type(record.inner).__name__.lower()
        for param, items in zip(record.params, per_param):
            if items is None:
                if adam:
                    full += 2 * param.numel() * param.element_size() + 4
                else:
                    exact = False
    return now, full, exact


def _allocate(slot: Slot, entries: list[_state.Entry]) -> None:
    pin = platform.pin_memory_supported()
    slot.host = [
        torch.empty(tuple(e.tensor.shape), dtype=e.tensor.dtype, device="cpu", pin_memory=pin)
        for e in entries
    ]


class Snapshotter:
    """Copies the training state into slots and back; owns the side stream."""

    def __init__(self) -> None:
        self._stream: Any = None

    @property
    def stream(self) -> Any:
        """The side stream for the big copies (created on first use)."""
        if self._stream is None:
            self._stream = platform.new_stream()
        return self._stream

    def capture(
        self, slot: Slot, step: int, chunks: list[Any], optimizer: Any, early: Early | None = None
    ) -> None:
        """Copy the state after training step ``step`` into ``slot``; with ``early``, its
        buffers and RNG states replace the live ones (the starting state: taken before the
        first forward, the rest just before the first update)."""
        started = time.perf_counter()
        slot.synchronize()  # a copy still running into these buffers must finish first
        collected = _state.collect(chunks, optimizer)
        extra, plans, group_steps, scalers = _state.collect_optimizer_state(collected)
        entries = collected.entries + extra
        signature = [(e.name, tuple(e.tensor.shape), e.tensor.dtype) for e in entries]
        if signature != slot.signature:
            _allocate(slot, entries)
            slot.signature = signature
        current = platform.current_stream()
        earlier = early.buffers if early is not None else {}
        for entry, host in zip(entries, slot.host):
            if entry.kind == _state.SMALL:
                source = earlier.get(entry.name)
                if source is None or source.shape != entry.tensor.shape:
                    source = entry.tensor
                host.copy_(source, non_blocking=True)
        events = [current.record_event()]
        side = self.stream
        side.wait_stream(current)
        with platform.stream_context(side):
            for entry, host in zip(entries, slot.host):
                if entry.kind == _state.BIG:
                    host.copy_(entry.tensor, non_blocking=True)
            events.append(side.record_event())
        slot.events = events
        slot.plans, slot.group_steps, slot.scalers = plans, group_steps, scalers
        slot.rng = early.rng if early is not None else capture_rng()
        slot.step, slot.taken, slot.healthy_after, slot.taken_at = step, True, 0, time.time()
        slot.capture_seconds = time.perf_counter() - started

    def restore(self, slot: Slot, chunks: list[Any], optimizer: Any) -> None:
        """Copy ``slot`` back into the live tensors, in place, bit for bit.

        :raises RestoreError: the model or optimizer layout differs from the snapshot's.
        """
        if slot.empty:
            raise RestoreError("rewind: no snapshot in this slot")
        slot.synchronize()
        collected = _state.collect(chunks, optimizer)
        base = [(e.name, tuple(e.tensor.shape), e.tensor.dtype) for e in collected.entries]
        if base != slot.signature[: len(base)]:
            raise RestoreError(
                f"rewind: the model or optimizer changed since {slot.label()} (parameters "
                "added, removed or reshaped); cannot restore"
            )
        with torch.no_grad():
            # In place through each tensor itself: bumps its version counter, so caches keyed
            # on it (fp8_blockwise's quantized weights) see the change.
            for entry, host in zip(collected.entries, slot.host):
                entry.tensor.copy_(host, non_blocking=True)
            for record, plan, steps, scaler in zip(
                collected.optimizers, slot.plans, slot.group_steps, slot.scalers
            ):
                self._restore_optimizer(record, plan, steps, scaler, slot.host)
        platform.current_stream().synchronize()
        if slot.rng is not None:
            restore_rng(slot.rng)

    @staticmethod
    def _restore_optimizer(
        record: _state.OptimizerRecord,
        plan: list[Any],
        group_steps: list[Any],
        scaler: Any,
        host: list[torch.Tensor],
    ) -> None:
        inner = record.inner
        if inner is not None:
            if len(plan) != len(record.params):
                raise RestoreError("rewind: the optimizer's parameter groups changed")
            for param, items in zip(record.params, plan):
                if items is None:
                    inner.state.pop(param, None)  # it had no state yet at the snapshot
                    continue
                live = inner.state[param]
                keys = {item.key for item in items}
                for key in [k for k in live if k not in keys]:
                    del live[key]
                for item in items:
                    if item.index is None:
                        live[item.key] = copy.deepcopy(item.value)
                        continue
                    saved = host[item.index]
                    current = live.get(item.key)
                    if (
                        isinstance(current, torch.Tensor)
                        and current.shape == saved.shape
                        and current.dtype == saved.dtype
                    ):
                        current.copy_(saved, non_blocking=True)
                    else:
                        live[item.key] = saved.to(item.device, copy=True)
            for group, step in zip(inner.param_groups, group_steps):
                if step is not None:
                    group["step"] = copy.deepcopy(step)
                elif "step" in group:
                    del group["step"]
        if scaler is not None and record.scaler is not None:
            state = {
                key: (
                    item.value
                    if item.index is None
                    else host[item.index].to(item.device, copy=True)
                )
                for key, item in scaler.items()
            }
            record.scaler.load_state_dict(state)
