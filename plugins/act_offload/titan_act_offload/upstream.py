"""How the plugin stands next to Megatron's own activation-memory features, read from the model
config of each schedule call (and from ``titan_configure`` when megatron.training builds it).

- ``overlap_moe_expert_parallel_comm`` (combined 1F1B runs two microbatches inside one schedule
  step, so (chunk, microbatch) units do not hold): the plugin steps aside for those schedules.
- ``moe_paged_stash`` (megatron-core 0.18+): Megatron's stash holds the routed experts'
  activations and brings them back itself; the MoE blocks (``moe``, ``experts``, and ``layer``,
  which contains them) are left to it, the other selected blocks are still offloaded. With no
  other block selected the plugin steps aside.
- ``fine_grained_activation_offloading`` / TE's ``cpu_offloading``: compose. Inside their regions
  their ``saved_tensors_hooks`` sit on top of ours, so each save is taken by exactly one of the
  two offloaders (autograd hands a save to the innermost hooks only).

Pure Python, nothing imported: the config is only read with ``getattr`` (older lines lack the
newer fields).
"""

from __future__ import annotations

from typing import Any, NamedTuple

EP_OVERLAP = "overlap_moe_expert_parallel_comm"
PAGED_STASH = "moe_paged_stash"
FINE_GRAINED = "fine_grained_activation_offloading"
TE_CPU_OFFLOAD = "cpu_offloading"
# Blocks whose forward runs the routed experts the paged stash manages.
STASHED_BLOCKS = frozenset({"moe", "experts", "layer"})


class Standing(NamedTuple):
    """The plugin's position for one model config.

    :param aside: ``(flag, sentence)`` when the plugin steps aside for the whole schedule.
    :param blocks_aside: selected blocks left to Megatron (the plugin leaves their saves alone).
    :param composes: ``(flag, sentence)`` for each Megatron feature the plugin works beside.
    """

    aside: tuple[str, str] | None = None
    blocks_aside: frozenset[str] = frozenset()
    composes: tuple[tuple[str, str], ...] = ()


def standing(config: Any, modules: tuple[str, ...]) -> Standing:
    """Where the plugin stands for ``config`` with ``modules`` (``TITAN_ACT_OFFLOAD_MODULES``)."""
    if config is None:
        return Standing()
    if getattr(config, EP_OVERLAP, False):
        return Standing(
            aside=(
                EP_OVERLAP,
                f"{EP_OVERLAP} (combined 1F1B) runs two microbatches inside one schedule step; "
                "activation offload is off for those schedules. Disable one of the two "
                "(TITAN_ACT_OFFLOAD=0 or the EP overlap).",
            )
        )
    composes: list[tuple[str, str]] = []
    blocks_aside: frozenset[str] = frozenset()
    if getattr(config, PAGED_STASH, False):
        blocks_aside = STASHED_BLOCKS & set(modules)
        left = [m for m in modules if m not in blocks_aside]
        if not left:
            return Standing(
                aside=(
                    PAGED_STASH,
                    f"{PAGED_STASH} holds the routed experts' activations and every selected "
                    f"block ({', '.join(modules)}) runs them: left to Megatron. Select other "
                    "blocks (TITAN_ACT_OFFLOAD_MODULES=attention,mlp) or turn the stash off.",
                ),
                blocks_aside=blocks_aside,
            )
        if blocks_aside:
            composes.append(
                (
                    PAGED_STASH,
                    f"{PAGED_STASH} holds the routed experts' activations: the "
                    f"{', '.join(sorted(blocks_aside))} blocks are left to it; act_offload "
                    f"offloads {', '.join(left)}",
                )
            )
    if getattr(config, FINE_GRAINED, False):
        regions = ", ".join(getattr(config, "offload_modules", None) or ()) or "none listed"
        composes.append(
            (
                FINE_GRAINED,
                f"Megatron's {FINE_GRAINED} takes the saves inside its regions "
                f"(offload_modules: {regions}); act_offload offloads the rest of the selected "
                "blocks (each save goes to one of the two)",
            )
        )
    if getattr(config, TE_CPU_OFFLOAD, False):
        composes.append(
            (
                TE_CPU_OFFLOAD,
                f"TE's {TE_CPU_OFFLOAD} takes the saves of the layers it offloads; act_offload "
                "offloads the rest",
            )
        )
    return Standing(blocks_aside=blocks_aside, composes=tuple(composes))


class Seen:
    """What the schedules of this process met: stepped-aside calls per flag, composing flags."""

    def __init__(self) -> None:
        self.aside: dict[str, tuple[str, int]] = {}  # flag -> (sentence, schedule calls)
        self.composes: dict[str, str] = {}  # flag -> sentence (the latest)

    def note(self, position: Standing, counted: bool = True) -> None:
        """Record ``position`` (``counted``: a schedule call, not just the configure hook)."""
        if position.aside is not None:
            flag, sentence = position.aside
            calls = self.aside.get(flag, ("", 0))[1]
            self.aside[flag] = (sentence, calls + int(counted))
        for flag, sentence in position.composes:
            self.composes[flag] = sentence

    def effects(self, ran: bool) -> dict[str, Any]:
        """``stepped_aside`` (flags, when no schedule ran with the plugin) and ``composes_with``
        (flags), for the effects table."""
        out: dict[str, Any] = {}
        if self.aside and not ran:
            out["stepped_aside"] = ", ".join(self.aside)
        if self.composes:
            out["composes_with"] = ", ".join(self.composes)
        return out

    def report(self) -> dict[str, Any]:
        """The same with sentences, and the schedule calls the plugin stood out of."""
        out: dict[str, Any] = {}
        if self.aside:
            out["stepped_aside"] = {flag: calls for flag, (_, calls) in self.aside.items()}
        if self.composes:
            out["composes_with"] = "; ".join(self.composes.values())
        return out

    def reason(self) -> str:
        """Why the plugin stood aside (empty when it never did)."""
        return "; ".join(sentence for sentence, _ in self.aside.values())
