"""weight_sync's patch records: where it meets SGLang and Megatron.

Never import SGLang or Megatron at module level: the engine calls a replacement factory right
after its target module has executed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.hosts.sglang import sglang_releases
from titan_plugins.patching import Patch, Signature
from titan_weight_sync.load_format import LOAD_FORMAT

UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"
SLIME_UPDATE = "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
MILES_UPDATE = "miles.backends.megatron_utils.update_weight.update_weight_from_distributed.mixin"


def _serving(serve_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A replacement factory for SGLang's ``update_weights_from_tensor`` on the scheduler that
    answers requests whose ``load_format`` is ``titan_weight_sync`` with
    ``engine_hooks.<serve_name>`` (every other request runs SGLang's own code)."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def update_weights_from_tensor(self: Any, recv_req: Any) -> Any:
            if getattr(recv_req, "load_format", None) != LOAD_FORMAT:
                return original(self, recv_req)
            try:
                from titan_weight_sync import engine_hooks

                return getattr(engine_hooks, serve_name)(self, recv_req)
            except Exception as err:  # a failure of ours must not take the scheduler down
                from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqOutput

                text = f"weight_sync failed: {type(err).__name__}: {err}"
                logging.getLogger("titan_plugins.weight_sync").warning(text, exc_info=True)
                return UpdateWeightsFromTensorReqOutput(success=False, message=text)

        return update_weights_from_tensor

    return factory


def _slime_send_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    """slime's ``UpdateWeightFromDistributed._send_weights`` through weight_sync (slime's own
    broadcast when weight_sync cannot serve the update)."""

    @functools.wraps(original)
    def _send_weights(self: Any, pbar: Any) -> None:
        from titan_weight_sync.slime_update import send_weights

        send_weights(original, self, pbar)

    return _send_weights


def _miles_update_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    """miles' ``DistBucketedWeightUpdateMixin.update_weights`` through weight_sync (miles' own
    update when weight_sync cannot serve it)."""

    @functools.wraps(original)
    def update_weights(self: Any) -> None:
        import torch

        from titan_weight_sync.miles_update import update_weights as through_weight_sync

        # miles' own method is @torch.no_grad(); wraps() does not carry the decorator over
        with torch.no_grad():
            through_weight_sync(original, self)

    return update_weights


def patches() -> list[Patch]:
    """New records for one activation (the engine keeps each record's status)."""
    return [
        Patch(
            id="weight_sync.engine_endpoint",
            target=f"{UPDATER}:SchedulerWeightUpdaterManager.update_weights_from_tensor",
            replace=_serving("serve"),
            requires=(sglang_releases("0.5.23"),),
            # a trainer's environment has no SGLang: the engine side is not for it
            optional=True,
            signature=Signature(
                positional=("self", "recv_req"),
                attrs=(
                    "SchedulerWeightUpdaterManager._select_runners",
                    "SchedulerWeightUpdaterManager._observe_weight_load",
                    "SchedulerWeightUpdaterManager.record_weight_version_after_update",
                    "SchedulerWeightUpdaterManager.flush_cache_after_weight_update",
                    "SchedulerWeightUpdaterManager.begin_weight_update",
                ),
                contains=("self._session is None",),
            ),
            rationale="answer weight_sync's hello / commit on the scheduler's event loop and "
            "load verified landed weights through SGLang's own loader, inside its session",
            upstream="sglang/srt/managers/scheduler_components/weight_updater.py "
            "SchedulerWeightUpdaterManager.update_weights_from_tensor (0.5.23)",
            remove_when="SGLang offers an authenticated one-sided update endpoint of its own",
        ),
        Patch(
            id="weight_sync.engine_endpoint_sessionless",
            target=f"{UPDATER}:SchedulerWeightUpdaterManager.update_weights_from_tensor",
            replace=_serving("serve_sessionless"),
            requires=(sglang_releases("0.5.15", "0.5.15"),),
            optional=True,
            signature=(
                Signature(
                    positional=("self", "recv_req"),
                    attrs=(
                        "SchedulerWeightUpdaterManager._observe_weight_load",
                        "SchedulerWeightUpdaterManager.flush_cache_after_weight_update",
                    ),
                    contains=(
                        "worker.update_weights_from_tensor(recv_req)",
                        "self.flush_cache_after_weight_update(recv_req)",
                    ),
                    # 0.5.23's session: this record is for the SGLang without one
                    lacks=("self._session",),
                ),
                Signature(
                    of="SchedulerWeightUpdaterManager.flush_cache_after_weight_update",
                    positional=("self", "recv_req"),
                ),
            ),
            rationale="answer weight_sync's hello / commit on the scheduler's event loop and "
            "load verified landed weights through SGLang's own loader while generation is paused "
            "(slime's SGLang pin has no weight-update session)",
            upstream="sglang/srt/managers/scheduler_components/weight_updater.py "
            "SchedulerWeightUpdaterManager.update_weights_from_tensor (0.5.15.post1)",
            remove_when="slime moves to an SGLang with the weight-update session (0.5.23's "
            "record serves it)",
        ),
        Patch(
            id="weight_sync.slime_broadcast",
            target=f"{SLIME_UPDATE}:UpdateWeightFromDistributed._send_weights",
            replace=_slime_send_weights,
            # slime is run from a checkout (no release of its own): gated on the Megatron it
            # runs (tested on 0.16 and 0.19; slime's 0.16.0rc0 passes on the signature)
            requires=(SUPPORTED_MEGATRON,),
            optional=True,
            signature=(
                Signature(
                    positional=("self", "pbar"),
                    attrs=(
                        "UpdateWeightFromDistributed._iter_non_expert_chunks",
                        "UpdateWeightFromDistributed._iter_expert_chunks",
                        "UpdateWeightFromDistributed._on_chunk",
                        "UpdateWeightFromDistributed.connect_rollout_engines",
                        "get_gloo_group",
                    ),
                    contains=(
                        "self._iter_non_expert_chunks(), self._iter_expert_chunks()",
                        "self._on_chunk(hf_chunk)",
                        "dist.barrier(group=get_gloo_group())",
                    ),
                ),
                Signature(
                    of="UpdateWeightFromDistributed.update_weights",
                    contains=("self.weight_version += 1", "self._send_weights(pbar)"),
                ),
            ),
            rationale="send slime's HF-converted buckets one-sided from every pipeline stage's "
            "source rank into the engines (one commit, all or nothing) instead of an NCCL "
            "broadcast from each stage; slime's broadcast runs when weight_sync cannot serve",
            upstream="slime/backends/megatron_utils/update_weight/"
            "update_weight_from_distributed.py UpdateWeightFromDistributed._send_weights "
            "(THUDM/slime 624b824a)",
            remove_when="slime ships a one-sided weight update of its own (its P2P RFC)",
        ),
        Patch(
            id="weight_sync.miles_update",
            target=f"{MILES_UPDATE}:DistBucketedWeightUpdateMixin.update_weights",
            replace=_miles_update_weights,
            # miles is run from a checkout too: gated on the Megatron it runs
            requires=(SUPPORTED_MEGATRON,),
            optional=True,
            signature=(
                Signature(
                    positional=("self",),
                    attrs=(
                        "DistBucketedWeightUpdateMixin._gather_and_update_non_expert_weights",
                        "DistBucketedWeightUpdateMixin._gather_and_update_expert_weights",
                        "get_gloo_group",
                    ),
                    contains=(
                        "self.weight_version += 1",
                        "self._pause_and_prepare_engines()",
                        "self._gather_and_update_non_expert_weights(self._update_weight_"
                        "implementation, pbar)",
                        "self._gather_and_update_expert_weights(self._update_weight_"
                        "implementation, pbar)",
                        "self._finalize_and_resume_engines()",
                    ),
                ),
                Signature(
                    of="DistBucketedWeightUpdateMixin._gather_and_update_non_expert_weights",
                    params=("update_bucket_weight_func", "pbar"),
                    contains=("update_bucket_weight_func(converted_named_tensors, pbar)",),
                ),
                Signature(
                    of="DistBucketedWeightUpdateMixin._gather_and_update_expert_weights",
                    params=("update_bucket_weight_func", "pbar"),
                ),
            ),
            rationale="send miles' HF-converted buckets (its TP / EP gathers, its convert_to_hf) "
            "one-sided from each stage's source rank, generation paused only for the commit, "
            "and commit once, all or nothing, in SGLang's session (miles' pause mode and "
            "selector); "
            "covers its broadcast and P2P updaters; miles' own update runs when weight_sync "
            "cannot serve",
            upstream="miles/backends/megatron_utils/update_weight/update_weight_from_distributed/"
            "mixin.py DistBucketedWeightUpdateMixin.update_weights (radixark/miles 31f1ca96)",
            remove_when="miles' P2P update authenticates its writers and commits all or nothing",
        ),
    ]
