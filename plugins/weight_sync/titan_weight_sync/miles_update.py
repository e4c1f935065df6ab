"""weight_sync inside miles' bucketed update (``DistBucketedWeightUpdateMixin.update_weights``,
the orchestration its ``UpdateWeightFromDistributed`` (NCCL broadcast) and ``UpdateWeightP2P``
(its own RDMA writes) share).

miles (``miles/backends/megatron_utils/update_weight/update_weight_from_distributed/mixin.py``)
pauses the engines and opens SGLang's session on rank 0, then hands each bucket to
``_update_weight_implementation`` from two passes that are collectives of every training rank:
its tensor-parallel gathers and ``convert_to_hf`` (dense), its expert-parallel gathers (experts).
The replacement runs miles' same two passes with weight_sync's callback instead: each bucket is
written one-sided from the stage's source rank (:class:`~titan_weight_sync.staged.StagedSync`),
and rank 0 commits once, inside the session weight_sync opens with miles' own pause mode and
selector. Generation is paused only for the commit, not while the buckets move (the hello, like
any SGLang weight request, waits for the requests in flight to finish).

When weight_sync cannot serve the update (an engine without its endpoint, an engine with
``pp_size`` > 1, a tensor the engines do not serve, a dead engine), rank 0 logs why, every rank
takes back the version it counted, and miles' own ``update_weights`` runs from the start. LoRA
updates are miles' own (adapters, not the model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from titan_weight_sync import held, stats
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.staged import StagedSync

logger = logging.getLogger("titan_plugins.weight_sync")


def update_weights(original: Callable[[Any], None], updater: Any) -> None:
    """miles' ``update_weights(self)`` through weight_sync; miles' own when it fails. A
    collective of every training rank, as miles' is."""
    import torch.distributed as dist

    if getattr(updater, "is_lora", False):
        original(updater)  # the adapters: miles' own path
        return
    group = _group()
    first = dist.get_rank(group) == 0
    updater.weight_version += 1
    try:
        count = _sync(updater, group, first)
    except WeightSyncError as err:
        stats.count("fallbacks")
        if first:
            logger.warning("%s; miles' own update runs", err)
        updater.weight_version -= 1  # miles' own update counts this update again
        original(updater)
        return
    if first:
        logger.info("weight_sync: weight version %s synced", updater.weight_version)
    stats.count("miles_tensors_sent", count)


def _sync(updater: Any, group: Any, first: bool) -> int:
    """miles' two passes, every bucket through weight_sync; the tensors this rank wrote."""
    import torch.distributed as dist

    stage = StagedSync(
        (lambda: held.engines(updater, _engine_urls(updater), **_session(updater)))
        if first
        else None,
        lambda: held.writer(updater),
        str(updater.weight_version),
        group,
    )
    # UpdateWeightP2P makes every rank of a stage a source (each writes its own engine rank):
    # one rank per stage writes here, the one miles' broadcast sends from
    writes = _is_stage_writer()

    def send(named: list[tuple[str, torch.Tensor]], pbar: Any) -> None:
        if writes:
            stage.send(dict(named))

    updater._gather_and_update_non_expert_weights(send, None)
    dist.barrier(group=group)
    updater._gather_and_update_expert_weights(send, None)
    dist.barrier(group=group)
    return stage.finish()


def _group() -> Any:
    """miles' gloo group of every training rank (the one its own update path uses)."""
    from miles.utils.distributed_utils import get_gloo_group

    return get_gloo_group()


def _is_stage_writer() -> bool:
    """Whether this rank writes its stage's buckets (data-parallel and tensor-parallel rank 0,
    miles' broadcast source)."""
    from miles.backends.training_utils.parallel import get_parallel_state

    state = get_parallel_state()
    return state.intra_dp_cp.rank == 0 and state.tp.rank == 0


def _session(updater: Any) -> dict[str, str]:
    """miles' own pause mode and session selector (``--pause-generation-mode``, and the draft
    model left out when the trainer has none to send)."""
    from miles.backends.megatron_utils.update_weight.common import weight_update_selector

    args = updater.args
    return {
        "pause_mode": getattr(args, "pause_generation_mode", "retract"),
        "selector": weight_update_selector(args),
    }


def _engine_urls(updater: Any) -> list[str]:
    """The HTTP addresses of miles' engines, from their Ray handles (``SGLangEngine``'s
    ``get_topology_info``)."""
    import ray

    infos = ray.get([engine.get_topology_info.remote() for engine in updater.rollout_engines])
    return [info["url"] for info in infos]
