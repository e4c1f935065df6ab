"""What plugins do to per-rank memory, as they state it through ``titan_memory_effect``.

The planner never copies a plugin's constants: it builds a :class:`MemoryLayout` for the launch,
asks every installed plugin (``titan_memory_effect(layout)``) and applies the
:class:`MemoryEffect` each one returns to the saved tensors it models
(:class:`~titan_plugins.plan.activations.Entry`: ``name``, ``module``, ``bytes``,
``fp8_bytes()``, ``pieces``, ...). Pure Python; plugins import this module to answer the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_plugins.plan.activations import Entry
    from titan_plugins.plan.config import PlanConfig


@dataclass(frozen=True)
class MemoryLayout:
    """What the planner asks plugins about: one launch, in Megatron terms.

    :param config: model, parallel layout and training setup
        (:class:`~titan_plugins.plan.config.PlanConfig`).
    :param resident_units: planner assumption (``plan --act-offload-resident``): how many of
        the newest in-flight (chunk, microbatch) units an offloading plugin keeps on the device
        (act_offload moves block by block and holds about one unit's worth: the block staged in
        forward, or the block backward reads and the one prefetched).
    """

    config: PlanConfig
    resident_units: int = 1


@dataclass(frozen=True)
class MemoryEffect:
    """One plugin's effect on the activation memory of a rank.

    :param plugin: the plugin's entry-point name; names the variant in the report.
    :param label: short column label of the text report (e.g. ``fp8``).
    :param legend: a few words for the report's legend (e.g. ``fp8_blockwise storage``).
    :param switch: the environment setting that turns it on (e.g. ``TITAN_ACT_OFFLOAD=1``).
    :param flags: Megatron flags it also needs, if any.
    :param description: what it does, in a few words, for the fit advice.
    :param stored_bytes: ``(tensor, bytes) -> bytes``: device bytes a saved tensor takes with
        the plugin, given its bytes so far (None: storage unchanged).
    :param offloaded: ``(tensors, sizes) -> [bool, ...]``: which saved tensors of one group
        (a transformer layer, the embedding or the head; each with its bytes so far) the plugin
        moves off the device while their unit waits for the backward (None: moves nothing).
        A whole group at once, so a rule may depend on the other tensors of the block.
    :param resident_units: the newest in-flight units whose offloaded tensors stay on the device.
    """

    plugin: str
    label: str
    legend: str
    switch: str
    flags: str = ""
    description: str = ""
    stored_bytes: Callable[[Entry, float], float] | None = None
    offloaded: Callable[[Sequence[Entry], Sequence[float]], Sequence[bool]] | None = None
    resident_units: int = 0

    @property
    def offloads(self) -> bool:
        """Whether this effect moves activations off the device."""
        return self.offloaded is not None


@dataclass(frozen=True)
class Variant:
    """A combination of effects the report shows (the configured run, each plugin, all)."""

    name: str
    label: str
    legend: str = ""
    effects: tuple[MemoryEffect, ...] = ()

    def unit_bytes(
        self, groups: Sequence[Sequence[Entry]], fp8: bool, dropped: set[str]
    ) -> tuple[float, float]:
        """(device bytes, offloadable bytes) of one unit's saved tensors.

        :param groups: the unit's saved tensors by group (embedding, each layer, head).
        :param fp8: the configured run already stores linear inputs as FP8.
        :param dropped: names megatron's own offloading keeps on the host.
        """
        total = offloadable = 0.0
        for group in groups:
            kept = [entry for entry in group if entry.name not in dropped]
            sizes = [entry.fp8_bytes() if fp8 else entry.bytes for entry in kept]
            for effect in self.effects:
                if effect.stored_bytes is not None:
                    sizes = [effect.stored_bytes(e, size) for e, size in zip(kept, sizes)]
            moved = [False] * len(kept)
            for effect in self.effects:
                if effect.offloaded is not None:
                    moved = [a or bool(b) for a, b in zip(moved, effect.offloaded(kept, sizes))]
            for size, away in zip(sizes, moved):  # one by one: the same sums as tensor by tensor
                total += size
                offloadable += size if away else 0.0
        return total, offloadable

    @property
    def resident_units(self) -> int | None:
        """Newest units kept whole on the device, or None when nothing is offloaded."""
        kept = [e.resident_units for e in self.effects if e.offloads]
        return max(kept) if kept else None


def _order(effect: MemoryEffect) -> tuple[bool, str]:
    # Storage changes first (they are cheaper to switch on and offloading moves what they
    # leave), then by name: the report's columns and the advice keep one order.
    return (effect.offloads, effect.plugin)


def variants(effects: Sequence[MemoryEffect]) -> list[Variant]:
    """``configured``, one variant per effect, and all of them together (two or more)."""
    ordered = sorted(effects, key=_order)
    out = [Variant("configured", "act")]
    out += [Variant(e.plugin, f"+{e.label}", e.legend, (e,)) for e in ordered]
    if len(ordered) > 1:
        both = len(ordered) == 2
        name = "+".join(e.plugin for e in ordered)
        out.append(
            Variant(name, "+both" if both else "+all", "both" if both else "all", tuple(ordered))
        )
    return out


def ask_plugins(layout: MemoryLayout) -> list[MemoryEffect]:
    """Every installed plugin's answer to ``titan_memory_effect(layout)``, on or off.

    The plan shows what each plugin would do when switched on, so the per-plugin switches do
    not hide one; a plugin that fails to load or to answer is left out with a warning.
    """
    from titan_plugins._log import logger
    from titan_plugins.manager import get_plugin_manager

    pm = get_plugin_manager(switches=False)
    effects: list[MemoryEffect] = []
    for impl in pm.hook.titan_memory_effect.get_hookimpls():
        try:
            effect: Any = impl.function(layout=layout)
        except Exception as err:  # one plugin's bug must not stop the plan
            logger.warning("plan: %s's titan_memory_effect raised %r", impl.plugin_name, err)
            continue
        if isinstance(effect, MemoryEffect):
            effects.append(effect)
        elif effect is not None:
            logger.warning(
                "plan: %s's titan_memory_effect returned %r, not a MemoryEffect",
                impl.plugin_name,
                type(effect).__name__,
            )
    return effects
