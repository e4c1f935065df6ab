"""Where rewind touches the training loop: the moment between iterations, the data iterator,
and the optimizer step's result."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from titan_rewind.errors import RewindError

if TYPE_CHECKING:
    from titan_rewind.config import RewindConfig

log = logging.getLogger("titan_plugins.rewind")


def no_store(config: RewindConfig) -> dict[str, Any]:
    """What ``SnapshotStore.describe`` says before the first step (without importing torch)."""
    from titan_rewind.doctor import default_budget

    return {
        "snapshots": [],
        "snapshots_taken": 0,
        "host_bytes": 0,
        "bytes_per_snapshot": 0,
        "host_budget": config.max_host_bytes or default_budget(),
    }


def unpack(result: Any) -> tuple[Any, Any]:
    """(update_successful, grad_norm) from an optimizer step's result."""
    if isinstance(result, tuple) and len(result) >= 2:
        return result[0], result[1]
    return result, None


def assert_between_steps() -> None:
    """A restore runs between iterations: no schedule (so no P2P / all-to-all transfer of
    pp_rdma or moe_ep_overlap) may be in flight in this thread."""
    from titan_plugins import train_step

    running = train_step.current_step()
    if running is not None:
        raise RewindError(
            f"rewind: refusing to restore inside a running {running.schedule} schedule call "
            "(transfers may be in flight); the optimizer step must follow forward_backward"
        )


def unsupported(optimizer: Any) -> str:
    """Why this optimizer setup cannot be restored safely, or ``""``.

    ``overlap_param_gather_with_optimizer_step`` starts the first parameter all-gather inside
    the optimizer step: a restore right after it would race that gather, and the gathered
    (pre-restore) shards would be used by the next forward.
    """
    config = getattr(optimizer, "config", None)
    if getattr(config, "overlap_param_gather_with_optimizer_step", False):
        return (
            "rewind: overlap_param_gather_with_optimizer_step is on: the parameter all-gather it "
            "starts inside the optimizer step would race a restore, so no snapshot is taken "
            "(turn it off to use rewind)"
        )
    return ""


def drop_batches(train: Any, steps: int) -> int:
    """Advance the step's data iterator(s) by ``steps`` steps of microbatches; returns how many
    microbatches were dropped per iterator (fewer when an iterator ends)."""
    if train is None:
        return 0
    iterators = train.kwargs.get("data_iterator")
    if not isinstance(iterators, list | tuple):
        iterators = [iterators]
    want = steps * max(train.num_microbatches, 1)
    dropped = 0
    for iterator in iterators:
        if iterator is None:
            continue
        count = 0
        try:
            for _ in range(want):
                next(iterator)
                count += 1
        except StopIteration:
            log.warning("rewind: the data iterator ended after dropping %d microbatches", count)
        dropped = max(dropped, count)
    return dropped
