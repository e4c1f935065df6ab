"""The process-wide runtime the megatron wrappers talk to: settings, the lazily built offloader,
and the schedule invocation in progress.

Importing this module does not import torch (activation may run inside ``import torch``): the
offloader and step machinery load on the first schedule call.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from titan_act_offload.config import OffloadConfig
from titan_act_offload.plan import INTERLEAVED, NO_PIPELINING, build_plan, schedule_events

if TYPE_CHECKING:
    from titan_act_offload.offloader import Offloader
    from titan_act_offload.step import Step

logger = logging.getLogger("titan_plugins.act_offload")

_CURRENT: Runtime | None = None


def current() -> Runtime | None:
    """The runtime of the latest activation (tests and benchmarks read ``.stats`` from it)."""
    return _CURRENT


class Runtime:
    """Settings plus the per-process state; cheap to create (no torch device work)."""

    def __init__(self, config: OffloadConfig, platform: Any = None) -> None:
        global _CURRENT
        self.config = config
        self._platform = platform
        self._offloader: Offloader | None = None
        self.step: Step | None = None
        self.last_plan: Any = None
        self._warned: set[str] = set()
        _CURRENT = self

    @property
    def offloader(self) -> Offloader:
        """The offloader, built on first use (streams and pool need the device)."""
        if self._offloader is None:
            from titan_act_offload.offloader import Offloader

            if self._platform is None:
                from titan_plugins import platform

                self._platform = platform
            self._offloader = Offloader(self.config, self._platform)
        return self._offloader

    @property
    def stats(self) -> Any:
        """The offloader's :class:`~titan_act_offload.accounting.OffloadStats`."""
        return self.offloader.stats

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
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        config = _model_config(models[0])
        if config is not None and getattr(config, "overlap_moe_expert_parallel_comm", False):
            self.warn_once(
                "ep_overlap",
                "act_offload: overlap_moe_expert_parallel_comm runs two microbatches inside one "
                "schedule step (combined 1F1B); activation offload is off for those schedules. "
                "Disable one of the two (TITAN_ACT_OFFLOAD=0 or the EP overlap).",
            )
            return None
        pp_size, pp_rank = _pipeline_position(kwargs)
        group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp_size
        events = schedule_events(
            kind, pp_size, pp_rank, kwargs["num_microbatches"], len(models), group
        )
        offloader = self.offloader
        stats = offloader.stats
        # Unit is a NamedTuple: the (chunk, microbatch) keys of the last step look it up as is.
        plan = build_plan(
            events,
            self.config.min_gap,
            unit_bytes=stats.unit_bytes or None,
            host_budget=self.config.max_host_bytes,
        )
        self.last_plan = plan
        offloader.param_storages = frozenset(
            p.untyped_storage().data_ptr() for m in models for p in m.parameters()
        )
        from titan_act_offload.step import Step

        self.step = Step(offloader, plan, models)
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


KIND_BY_FUNCTION = {
    "forward_backward_no_pipelining": NO_PIPELINING,
    "forward_backward_pipelining_without_interleaving": "1f1b",
    "forward_backward_pipelining_with_interleaving": INTERLEAVED,
}
