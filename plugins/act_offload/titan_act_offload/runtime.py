"""The process-wide runtime the hooks talk to: settings, the lazily built offloader, and the
schedule invocation in progress.

Importing this module imports neither torch nor the plan (activation runs while Megatron
imports): the offloader and the step machinery load on the first schedule call.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from titan_act_offload.settings import OffloadSettings

if TYPE_CHECKING:
    from titan_act_offload.offloader import Offloader
    from titan_act_offload.plan import OffloadPlan
    from titan_act_offload.step import Step
    from titan_act_offload.upstream import Seen

logger = logging.getLogger("titan_plugins.act_offload")

_CURRENT: Runtime | None = None


def current() -> Runtime | None:
    """The runtime of the latest activation (tests and benchmarks read its report)."""
    return _CURRENT


class Runtime:
    """Settings plus the per-process state; cheap to create (no torch device work)."""

    def __init__(self, settings: OffloadSettings, platform: Any = None) -> None:
        global _CURRENT
        self.settings = settings
        self._platform = platform
        self._offloader: Offloader | None = None
        self.step: Step | None = None
        self.last_plan: OffloadPlan | None = None
        self.blocks_patched: set[str] = set()  # block forwards the engine actually wrapped
        self._warned: set[str] = set()
        self._upstream: Seen | None = None
        _CURRENT = self

    @property
    def started(self) -> bool:
        """Whether a schedule ran with the plugin (the offloader exists)."""
        return self._offloader is not None

    @property
    def offloader(self) -> Offloader:
        """The offloader, built on first use (streams and pool need the device)."""
        if self._offloader is None:
            from titan_act_offload.offloader import Offloader

            if self._platform is None:
                from titan_plugins import platform

                self._platform = platform
            self._offloader = Offloader(self.settings, self._platform)
        return self._offloader

    @property
    def upstream(self) -> Seen:
        """Megatron's own features met so far: stepped aside for, composed with (built on first
        use: nothing beyond the settings loads while megatron imports)."""
        if self._upstream is None:
            from titan_act_offload.upstream import Seen

            self._upstream = Seen()
        return self._upstream

    @property
    def stats(self) -> Any:
        """The offloader's :class:`~titan_act_offload.accounting.OffloadStats`."""
        return self.offloader.stats

    def report(self) -> dict[str, Any]:
        """Settings, and once a schedule ran, the offloader's counters (``stats``,
        ``host_pool``)."""
        report: dict[str, Any] = dict(self.settings.as_dict())
        if self._offloader is not None:
            report.update(self._offloader.report())
        report.update(self.upstream.report())
        return report

    def effects(self) -> dict[str, Any]:
        """What the plugin did in this process, as numbers (empty before the first schedule).

        ``offloaded_bytes``: bytes copied to host; ``reloaded_bytes``: brought back;
        ``peak_saved_bytes``: peak of the stage's device-resident saved activations (what the
        forward saved, offloaded blocks net of their copies); ``peak_saved_bytes_without``: the
        same tensors' peak had nothing moved (the no-offload baseline of this very run);
        ``steps``: training schedules run; ``offloaded_units`` / ``units``: (chunk, microbatch)
        units the last step's plan offloaded, of all; ``skipped_tensors`` / ``skipped_bytes``:
        saved tensors left where they were (per reason: :meth:`skipped`).
        Next to Megatron's own features (``upstream.py``): ``stepped_aside`` names the flags the
        plugin stood aside for when no schedule ran with it (instead of a row of zeros), and
        ``composes_with`` the ones it worked beside.
        """
        beside = self.upstream.effects(ran=self._offloader is not None)
        if self._offloader is None:
            return beside
        stats = self._offloader.stats
        plan = self.last_plan
        return {
            "offloaded_bytes": stats.offloaded_bytes,
            "reloaded_bytes": stats.prefetched_bytes + stats.late_reload_bytes,
            "peak_saved_bytes": stats.peak_stage,
            "peak_saved_bytes_without": stats.peak_stage_live,
            "steps": stats.steps,
            "offloaded_units": len(plan.offload) if plan is not None else 0,
            "units": len(plan.units()) if plan is not None else 0,
            "skipped_tensors": sum(stats.skipped.values()),
            "skipped_bytes": sum(stats.skipped_bytes.values()),
            **beside,
        }

    def skipped(self) -> dict[str, dict[str, int]]:
        """Per reason, the saved tensors left where they were: ``{"tensors": n, "bytes": b}``.

        Reasons: ``leaf`` (no grad_fn and not marked as an activation: data, masks, indices,
        norm statistics), ``parameter_or_subclass`` / ``parameter_view``, ``stage_input`` (the
        tensor received from the previous stage), ``empty``, ``small`` (the size rule),
        ``not_device_strided`` / ``not_dense``, ``modified_in_place``, ``released_storage``
        (megatron's output-discarding checkpoints), ``host_budget``,
        ``other_saved_tensors_hooks`` (blocks another hook owns; no bytes counted).
        """
        if self._offloader is None:
            return {}
        stats = self._offloader.stats
        return {
            reason: {"tensors": count, "bytes": stats.skipped_bytes.get(reason, 0)}
            for reason, count in sorted(stats.skipped.items())
        }

    def why_nothing_moved(self) -> str:
        """Why no byte was offloaded (empty when some were)."""
        if self._offloader is not None and self._offloader.stats.offloaded_bytes:
            return ""
        return self._why_nothing_moved()

    def _why_nothing_moved(self) -> str:
        if self._offloader is None or self.last_plan is None:
            return "no training schedule ran with the plugin"
        if self.settings.dry_run:
            return "TITAN_ACT_OFFLOAD_DRY_RUN=1"
        if not self.last_plan.offload:
            return (
                "no microbatch waits between its forward and its backward on this stage "
                f"(TITAN_ACT_OFFLOAD_MIN_GAP={self.settings.min_gap}; the last pipeline stage runs "
                "each backward right after its forward: MIN_GAP=0 offloads block by block)"
            )
        return "every saved tensor was skipped (see skipped)"

    def warn_once(self, key: str, message: str) -> None:
        """Log ``message`` the first time ``key`` comes up."""
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def begin_step(self, kind: str, kwargs: dict[str, Any]) -> Step | None:
        """A schedule is starting: build its plan, or return None to stay out of the way."""
        if self.step is not None or kwargs.get("forward_only"):
            return None
        model = kwargs.get("model")
        models = list(model) if isinstance(model, list | tuple) else [model]
        config = _model_config(models[0])
        from titan_act_offload.upstream import standing

        position = standing(config, self.settings.modules)
        self.upstream.note(position)
        for flag, sentence in ((position.aside,) if position.aside else ()) + position.composes:
            self.warn_once(flag, f"act_offload: {sentence}")
        if position.aside is not None:
            return None
        from titan_act_offload.plan import build_plan, schedule_events
        from titan_act_offload.step import Step

        pp_size, pp_rank = _pipeline_position(kwargs)
        group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp_size
        events = schedule_events(
            kind, pp_size, pp_rank, kwargs["num_microbatches"], len(models), group
        )
        offloader = self.offloader
        # Unit is a NamedTuple: the (chunk, microbatch) keys of the last step look it up as is.
        plan = build_plan(
            events,
            self.settings.min_gap,
            unit_bytes=offloader.stats.unit_bytes or None,
            host_budget=self.settings.max_host_bytes,
        )
        self.last_plan = plan
        offloader.param_storages = frozenset(
            p.untyped_storage().data_ptr() for m in models for p in m.parameters()
        )
        self.step = Step(offloader, plan, models, blocks_aside=position.blocks_aside)
        return self.step

    def end_step(self, step: Step) -> None:
        """The schedule returned (or raised)."""
        try:
            step.finish()
        finally:
            self.step = None


def _model_config(model: Any) -> Any:
    try:
        from megatron.core.utils import get_model_config

        return get_model_config(model)
    except Exception:
        return getattr(model, "config", None)


def _pipeline_position(kwargs: dict[str, Any]) -> tuple[int, int]:
    """(pipeline size, rank) from the schedule's arguments, else megatron's parallel_state."""
    group = None
    collection = kwargs.get("pg_collection")
    if collection is not None:
        group = getattr(collection, "pp", None)
    communicator = kwargs.get("p2p_communicator")
    if group is None and communicator is not None:
        group = getattr(communicator, "pp_group", None)
    if group is not None:
        return group.size(), group.rank()
    from megatron.core import parallel_state

    return (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
