"""One invocation of a megatron-core schedule (one training step on this stage): maps the
schedule's forward_step / backward_step calls to plan units, checks them against the planned
order, and fires the planned prefetches."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch

from titan_act_offload.offloader import Offloader
from titan_act_offload.plan import Event, OffloadPlan, Unit
from titan_act_offload.records import UnitState

logger = logging.getLogger("titan_plugins.act_offload")


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor of a schedule value (a tensor, or a list of them)."""
    while isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
    return value if isinstance(value, torch.Tensor) else None


def tensor_storages(value: Any) -> frozenset[int]:
    """Storage addresses of the tensors in a schedule value (for stage-input exclusion)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return frozenset(t.untyped_storage().data_ptr() for t in values if isinstance(t, torch.Tensor))


class Step:
    """Tracks one schedule invocation against its :class:`OffloadPlan`."""

    def __init__(
        self,
        offloader: Offloader,
        plan: OffloadPlan,
        models: list[Any],
        blocks_aside: frozenset[str] = frozenset(),
    ) -> None:
        self.offloader = offloader
        self.plan = plan
        self.models = models
        # Selected blocks Megatron manages in this schedule (upstream.py): their forwards run
        # without our hooks, their saves fall to the unit's outside accounting (never moved).
        self.blocks_aside = blocks_aside
        self.following_plan = True
        self.mismatches = 0
        self._index = 0
        self._forwards: dict[int, int] = defaultdict(int)
        self._units: dict[Unit, UnitState] = {}
        self._outputs: dict[int, tuple[torch.Tensor, Unit]] = {}
        self._bytes: dict[Unit, int] = {}

    def chunk_of(self, model: Any, vp_stage: int | None) -> int:
        """Index of ``model`` among the schedule's model chunks."""
        for index, chunk in enumerate(self.models):
            if chunk is model:
                return index
        return vp_stage or 0

    def _advance(self, event: Event) -> None:
        index = self._index
        self._index += 1
        if self.following_plan:
            planned = self.plan.events[index] if index < len(self.plan.events) else None
            if planned != event:
                self.mismatches += 1
                self.following_plan = False
                logger.warning(
                    "act_offload: schedule step %d is %s, the plan expected %s; offloading stops "
                    "for this step (activations already on host reload on demand).",
                    index,
                    event,
                    planned,
                )
        if self.following_plan:
            for unit in self.plan.prefetch_at.get(index, ()):
                state = self._units.get(unit)
                if state is not None:
                    self.offloader.prefetch_unit(state)
        self.offloader.poll()

    def begin_forward(self, model: Any, vp_stage: int | None, input_tensor: Any) -> UnitState:
        """forward_step is about to run ``model`` on its next microbatch."""
        chunk = self.chunk_of(model, vp_stage)
        unit = Unit(chunk, self._forwards[chunk])
        self._forwards[chunk] += 1
        self._advance(Event("F", unit))
        offload = self.following_plan and unit in self.plan.offload
        state = self.offloader.begin_unit(unit, offload, tensor_storages(input_tensor))
        self._units[unit] = state
        return state

    def end_forward(self, state: UnitState, output: Any) -> None:
        """forward_step returned ``output`` (what the schedule later hands to backward_step)."""
        self.offloader.end_unit_forward(state)
        self._bytes[state.unit] = state.saved
        tensor = first_tensor(output)
        if tensor is not None:
            self._outputs[id(tensor)] = (tensor, state.unit)

    def begin_backward(self, output_tensor: Any) -> Unit | None:
        """backward_step is about to run on ``output_tensor``: which unit, and prefetch."""
        tensor = first_tensor(output_tensor)
        entry = self._outputs.pop(id(tensor), None) if tensor is not None else None
        unit = entry[1] if entry is not None and entry[0] is tensor else None
        self._advance(Event("B", unit) if unit is not None else Event("B", Unit(-1, -1)))
        return unit

    def end_backward(self, unit: Unit | None) -> None:
        """backward_step returned: the unit's activations have been consumed."""
        if unit is not None:
            state = self._units.pop(unit, None)
            if state is not None:
                self.offloader.end_unit_backward(state)

    def finish(self) -> None:
        """The schedule returned: settle copies and publish per-unit bytes."""
        self.offloader.synchronize()
        self.offloader.current = None
        stats = self.offloader.stats
        stats.steps += 1
        stats.schedule_mismatches += self.mismatches
        stats.unit_bytes = {tuple(u): b for u, b in self._bytes.items()}
        for state in self._units.values():  # units whose backward this schedule did not run
            self.offloader.end_unit_backward(state)
        self._units.clear()
        self._outputs.clear()
