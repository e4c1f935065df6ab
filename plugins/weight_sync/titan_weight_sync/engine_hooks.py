"""Where the engine side meets SGLang (imported only inside an SGLang scheduler, by the patched
``update_weights_from_tensor``; SGLang is imported lazily).

A message arrives as SGLang's own ``update_weights_from_tensor`` request with ``load_format``
``titan_weight_sync``. It is answered here on the scheduler's event loop, between batches, as
SGLang answers its own weight requests. So the load runs where SGLang's own loads run, and
inside the session the trainer opened with ``begin_weight_update``. On success SGLang records
the request's ``weight_version`` and flushes the cache, as for its own update.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from titan_weight_sync import stats
from titan_weight_sync.engine_side import EngineEndpoint, Refused
from titan_weight_sync.errors import WeightSyncError

logger = logging.getLogger("titan_plugins.weight_sync")
_ENDPOINT: dict[str, EngineEndpoint] = {}


def endpoint(manager: Any) -> EngineEndpoint:
    """This scheduler's endpoint (one per process, built at the first message)."""
    found = _ENDPOINT.get("this")
    if found is None:
        model_dir = manager.tp_worker.model_runner.model_config.model_path
        found = _ENDPOINT["this"] = EngineEndpoint(model_dir)
    return found


def serve(manager: Any, recv_req: Any) -> Any:
    """Answer one titan_weight_sync message on the scheduler (``manager`` is SGLang's
    ``SchedulerWeightUpdaterManager``); returns SGLang's reply struct."""
    import msgspec
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqOutput
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    op = ""  # known once the endpoint has read the message
    try:
        if getattr(parallel, "tp_size", 1) != 1:
            raise Refused(
                f"engines with tp_size {parallel.tp_size} are not served yet (tp_size 1 only); "
                "use the framework's own weight update"
            )
        payloads = recv_req.serialized_named_tensors
        raw = payloads[0] if len(payloads) == 1 else None

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

        op, text = endpoint(manager).handle(raw, manager._session is not None, load)
        success = True
    except Refused as err:
        success, text = False, f"weight_sync refused the {err.op or 'message'}: {err}"
        logger.warning(text)
    except Exception as err:  # answer the trainer; never take the scheduler down
        stats.count("failed")
        success, text = False, f"weight_sync failed: {type(err).__name__}: {err}"
        logger.warning(text, exc_info=True)
    if success and op == "commit":
        manager.record_weight_version_after_update(recv_req.weight_version)
        success, text = manager.flush_cache_after_weight_update(recv_req, success, text)
    torch.distributed.barrier(group=manager.tp_cpu_group)
    return UpdateWeightsFromTensorReqOutput(success=success, message=text)
