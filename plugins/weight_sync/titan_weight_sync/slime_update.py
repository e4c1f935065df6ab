"""weight_sync inside slime's broadcast update (``UpdateWeightFromDistributed._send_weights``).

slime (``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``) pauses
and flushes the engines on global rank 0, then calls ``_send_weights`` on every training rank:
its own iterators all-gather each tensor-parallel weight, convert it to Hugging Face names and
layouts with slime's ``convert_to_hf`` (the framework's conversion: weight_sync writes no third
one), expert-parallel-gather the experts, and yield buckets on the source rank of each pipeline
stage; each bucket is broadcast to every engine over an NCCL group. The replacement keeps
slime's iterators (their gathers are collectives of every rank) and sends each bucket with
:func:`~titan_weight_sync.staged.staged_sync` instead: one-sided writes from every stage's source
rank, one commit on rank 0. When weight_sync cannot serve the update (an engine without its
endpoint, a tensor the engines do not serve, a dead engine), every rank logs why and slime's own
broadcast runs, over the group slime connected as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from titan_weight_sync import held, stats
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.staged import staged_sync

logger = logging.getLogger("titan_plugins.weight_sync")


def send_weights(original: Callable[[Any, Any], None], updater: Any, pbar: Any) -> None:
    """slime's ``_send_weights(self, pbar)`` through weight_sync; slime's own when it fails.
    A collective of every training rank, as slime's is."""
    import torch.distributed as dist

    group = _group()
    first = dist.get_rank(group) == 0
    try:
        count = staged_sync(
            # slime pauses its engines with SGLang's default mode, abort (its SGLangEngine
            # posts an empty pause_generation): the commit pauses the same way
            (lambda: held.engines(updater, _engine_urls(updater), pause_mode="abort"))
            if first
            else None,
            lambda: held.writer(updater),
            _pieces(updater, pbar, group),
            str(updater.weight_version),
            group,
        )
    except WeightSyncError as err:
        stats.count("fallbacks")
        if first:
            logger.warning("%s; slime's own broadcast update runs", err)
        original(updater, pbar)
        return
    if first:
        logger.info("weight_sync: weight version %s synced", updater.weight_version)
    stats.count("slime_tensors_sent", count)


def _pieces(updater: Any, pbar: Any, group: Any) -> Iterator[dict[str, torch.Tensor]]:
    """slime's own buckets (dense, then experts; a gloo barrier after each pass, as slime
    does); empty on every rank but the stages' source ranks."""
    import torch.distributed as dist

    for buckets in (updater._iter_non_expert_chunks(), updater._iter_expert_chunks()):
        for bucket in buckets:
            updater._on_chunk(bucket)
            yield dict(bucket)
            if pbar is not None:
                pbar.update(1)
        dist.barrier(group=group)


def _group() -> Any:
    """slime's gloo group of every training rank (the one its own update path uses)."""
    from slime.utils.distributed_utils import get_gloo_group

    return get_gloo_group()


def _engine_urls(updater: Any) -> list[str]:
    """The HTTP addresses of slime's engines, from their Ray handles (``SGLangEngine.get_url``)."""
    import ray

    return ray.get([engine.get_url.remote() for engine in updater.rollout_engines])
