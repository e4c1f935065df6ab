"""Where the engine side meets SGLang (imported only inside an SGLang scheduler, by the patched
``update_weights_from_tensor``; SGLang is imported lazily).

A message arrives as SGLang's own ``update_weights_from_tensor`` request with ``load_format``
``titan_weight_sync``. It is answered here on the scheduler's event loop, between batches, as
SGLang answers its own weight requests, so the load runs where SGLang's own loads run:

- SGLang 0.5.23 (:func:`serve`): inside the weight-update session the trainer opened with
  ``begin_weight_update``; on success the scheduler records the request's ``weight_version`` and
  flushes the cache, as for SGLang's own update;
- SGLang 0.5.15.post1 (:func:`serve_sessionless`, slime's pin): it has no session, so a commit is
  loaded only while generation is paused (``pause_generation``); SGLang's tokenizer manager
  records the version of a successful request itself, and the scheduler flushes the cache.

SGLang hands each request to every tensor-parallel rank of the engine. Rank 0 holds the landing
region and decides; with ``tp_size`` > 1 it sends the other ranks the verdict and the verified
bytes, and each rank loads its own shard (:mod:`titan_weight_sync.engine_tp`). Engines with
``pp_size`` > 1 are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from titan_weight_sync import engine_tp, stats
from titan_weight_sync.engine_side import EngineEndpoint, Loader, Refused
from titan_weight_sync.errors import WeightSyncError

logger = logging.getLogger("titan_plugins.weight_sync")
_ENDPOINT: dict[str, EngineEndpoint] = {}
AfterCommit = Callable[[bool, str], tuple[bool, str]]


def endpoint(manager: Any, session: bool = True) -> EngineEndpoint:
    """This scheduler's endpoint (one per process, built at the first message)."""
    found = _ENDPOINT.get("this")
    if found is None:
        model_dir = manager.tp_worker.model_runner.model_config.model_path
        found = _ENDPOINT["this"] = EngineEndpoint(model_dir, session=session)
    return found


def serve(manager: Any, recv_req: Any) -> Any:
    """Answer one titan_weight_sync message on an SGLang 0.5.23 scheduler (``manager`` is its
    ``SchedulerWeightUpdaterManager``); returns SGLang's reply struct."""
    import msgspec
    from sglang.srt.runtime_context import get_parallel

    def load(named: list[tuple[str, torch.Tensor]]) -> int:
        with manager._observe_weight_load("titan_weight_sync"):
            for _, runner in manager._select_runners(manager._session.selector):
                ok, message = runner.weight_updater.update_weights_from_tensor(
                    named_tensors=named, load_format=None
                )
                if not ok:
                    raise WeightSyncError(f"SGLang's loader refused the weights: {message}")
        manager._session = msgspec.structs.replace(manager._session, loaded_weights=True)
        return len(named)

    def after_commit(success: bool, text: str) -> tuple[bool, str]:
        manager.record_weight_version_after_update(recv_req.weight_version)
        return manager.flush_cache_after_weight_update(recv_req, success, text)

    not_ready = ""
    if manager._session is None:
        not_ready = "no weight-update session is open (call begin_weight_update first)"
    parallel = get_parallel()
    return _answer(
        manager, recv_req, (parallel.tp_group, parallel.pp_size), load, not_ready, after_commit,
        session=True,
    )  # fmt: skip


def serve_sessionless(manager: Any, recv_req: Any) -> Any:
    """Answer one titan_weight_sync message on an SGLang 0.5.15.post1 scheduler (no session:
    a commit loads only while generation is paused); returns SGLang's reply struct."""

    def load(named: list[tuple[str, torch.Tensor]]) -> int:
        with manager._observe_weight_load("titan_weight_sync"):
            ok, message = manager.tp_worker.model_runner.update_weights_from_tensor(
                named_tensors=named, load_format=None
            )
        if not ok:
            raise WeightSyncError(f"SGLang's loader refused the weights: {message}")
        return len(named)

    def after_commit(success: bool, text: str) -> tuple[bool, str]:
        try:  # 0.5.15.post1 asserts that the flush went through
            manager.flush_cache_after_weight_update(recv_req)
        except AssertionError:
            return False, (
                "the weights were loaded, but the cache was not flushed because requests are "
                "still running or queued: retract them, then call /flush_cache"
            )
        return success, text

    scheduler = manager.scheduler
    not_ready = ""
    if manager.draft_worker is not None:
        not_ready = "engines with a speculative draft model are not served on this SGLang yet"
    elif not getattr(scheduler, "_engine_paused", False):
        not_ready = "generation is not paused (call pause_generation first)"
    elif recv_req.flush_cache and not manager.is_fully_idle():
        # 0.5.15.post1 flushes only an idle engine and asserts the flush after a load: refuse
        # before loading rather than load and then report a failure
        not_ready = (
            "requests are still running or queued, so the cache could not be flushed after "
            "the load: retract them first"
        )
    from sglang.srt.distributed.parallel_state import get_pp_group, get_tp_group

    engine = (get_tp_group(), get_pp_group().world_size)
    return _answer(manager, recv_req, engine, load, not_ready, after_commit, session=False)


def _answer(
    manager: Any,
    recv_req: Any,
    engine: tuple[engine_tp.TPGroup, int],
    load: Loader,
    not_ready: str,
    after_commit: AfterCommit,
    session: bool,
) -> Any:
    """The answer both SGLang lines share, on every TP rank of the engine (``engine``: SGLang's
    TP ``GroupCoordinator`` and the number of pipeline stages): rank 0 reads the message and
    lets the endpoint decide; with more ranks, it then sends them the verdict and the verified
    bytes (:mod:`engine_tp`). On a commit that loaded, every rank does what SGLang does after
    its own update (``after_commit``)."""
    group, stages = engine
    why = ""
    try:
        if stages != 1:  # every stage would need its own landing region and commit
            raise Refused(
                f"engines with pp_size {stages} are not served yet (pp_size 1, any tp_size); "
                "use the framework's own weight update"
            )
        this = endpoint(manager, session)
    except Exception as err:
        why = f"weight_sync refused the message: {err}"
    if group.world_size > 1:  # the ranks agree before any of them waits for a verdict
        whys = engine_tp.gather(group, why)
        why = next((w for w in whys if w), "")
    if why:
        if group.rank_in_group == 0:
            logger.warning(why)
        return _reply(manager, False, why)
    if group.rank_in_group != 0:
        return _reply(manager, *_follow(group, this, load, after_commit))
    leader = engine_tp.Leader(group, this, this.settings.staging_bytes, load)
    op = ""  # known once the endpoint has read the message
    try:
        payloads = recv_req.serialized_named_tensors
        raw = payloads[0] if len(payloads) == 1 else None
        op, text = this.handle(raw, leader.load if group.world_size > 1 else load, not_ready)
        success = True
    except Refused as err:
        success, text = False, f"weight_sync refused the {err.op or 'message'}: {err}"
        logger.warning(text)
    except Exception as err:  # answer the trainer; never take the scheduler down
        stats.count("failed")
        success, text = False, f"weight_sync failed: {type(err).__name__}: {err}"
        logger.warning(text, exc_info=True)
    finally:
        if group.world_size > 1:
            leader.finish()  # the other ranks wait for a verdict on every message
    # the other ranks go on after a load that succeeded everywhere, so rank 0 does too
    if (success and op == "commit") or leader.loaded:
        success, text = _after(after_commit, success, text)
    return _reply(manager, success, text)


def _after(after_commit: AfterCommit, success: bool, text: str) -> tuple[bool, str]:
    """What SGLang does after an update (record the version, flush), never raising: every rank
    must still reach the barrier in :func:`_reply`."""
    try:
        return after_commit(success, text)
    except Exception as err:
        logger.warning("weight_sync: after the load: %s", err, exc_info=True)
        return False, f"weight_sync loaded the update, then failed: {type(err).__name__}: {err}"


def _reply(manager: Any, success: bool, text: str) -> Any:
    """SGLang's reply struct, after the TP ranks meet (as SGLang's own weight requests do)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqOutput

    torch.distributed.barrier(group=manager.tp_cpu_group)
    return UpdateWeightsFromTensorReqOutput(success=success, message=text)


def _follow(
    group: engine_tp.TPGroup, this: EngineEndpoint, load: Loader, after: AfterCommit
) -> tuple[bool, str]:
    """A TP rank other than 0: load what rank 0 verified, then what SGLang does after an
    update. Only rank 0's answer reaches the trainer; this one goes to the log. Never raises:
    every rank must reach the barrier in :func:`_reply`."""
    try:
        if not engine_tp.follow(group, this.slots, load):
            return True, ""  # not a load (a hello, an abort or a refusal, answered by rank 0)
    except Exception as err:
        logger.warning("weight_sync: TP rank %d: %s", group.rank_in_group, err)
        return False, str(err)
    return _after(after, True, "")
