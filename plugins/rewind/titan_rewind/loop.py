"""Where rewind touches the training loop: the moment between iterations, the data iterator,
and the optimizer step's result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_rewind.errors import RewindError

if TYPE_CHECKING:
    from titan_rewind.config import RewindConfig


def no_store(config: RewindConfig) -> dict[str, Any]:
    """What ``SnapshotStore.describe`` says before the first step (without importing torch)."""
    from titan_rewind.budget import default_budget

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
    from titan_plugins.hosts.megatron import train_step

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


@dataclass
class Skip:
    """What dropping microbatches from this rank's data iterator(s) did.

    :param wanted: microbatches to drop from each data iterator.
    :param dropped: the fewest dropped from one of this rank's data iterators (``wanted`` when
        every one gave them; 0 on a rank without data iterators).
    :param iterators: distinct data iterators on this rank (``None`` entries, stages that read
        no data, are not counted).
    :param problem: why fewer than ``wanted`` were dropped ("" when all were).
    """

    wanted: int = 0
    dropped: int = 0
    iterators: int = 0
    problem: str = ""


def _source(iterator: Any) -> Any:
    """Where microbatches really come from: Megatron-LM's ``RerunDataIterator`` wraps the loop's
    iterator and, outside ``--rerun-mode disabled``, keeps what it yields for a replay (and
    replays saved ones while ``replaying``); dropping reads its inner iterator, so a dropped
    batch is neither saved nor replayed."""
    if (
        type(iterator).__name__ == "RerunDataIterator"
        or (hasattr(iterator, "saved_microbatches") and hasattr(iterator, "replaying"))
    ) and hasattr(iterator, "iterable"):
        return iterator.iterable
    return iterator


def _drop(iterator: Any, want: int) -> tuple[int, str]:
    """Advance one iterator by ``want`` microbatches: (dropped, problem)."""
    if not hasattr(type(iterator), "__next__"):
        if hasattr(iterator, "get_next") and hasattr(iterator, "micro_batch_indices"):
            return 0, (
                "slime's DataIterator holds exactly the microbatches of this rollout's steps "
                "(megatron reads them by offset); dropping some would make a later step of the "
                "rollout read past its end, so none is dropped"
            )
        return 0, f"the data iterator ({type(iterator).__name__}) is not a Python iterator"
    count = 0
    try:
        for _ in range(want):
            next(iterator)
            count += 1
    except StopIteration:
        if count == 0:
            return 0, (
                "the data iterator ended at once: the training loop hands the schedule a new "
                "iterator every step (this one ended with its step), so the batches of later "
                "steps cannot be dropped from it"
            )
        return count, f"the data iterator ended after {count} of them (the end of the data)"
    return count, ""


def drop_batches(train: Any, steps: int) -> Skip:
    """Advance the last training call's data iterator(s) by ``steps`` steps of microbatches.

    Handles what megatron's schedules are given: one iterator, a list with one per virtual
    pipeline chunk (``None`` on stages without data; an iterator listed twice is advanced once),
    Megatron-LM's ``RerunDataIterator`` (its inner iterator is advanced). Reports how many were
    dropped and, truthfully, why not all: an iterator that ends with its step (a new one each
    step), slime's per-rollout DataIterator (dropping would break the rollout's later steps),
    anything that is not an iterator.
    """
    if train is None:
        return Skip(problem="no training call known, so its data iterator is unknown")
    want = steps * max(train.num_microbatches, 1)
    given = train.kwargs.get("data_iterator")
    items = list(given) if isinstance(given, list | tuple) else [given]
    seen: set[int] = set()
    counts: list[int] = []
    problems: list[str] = []
    for item in items:
        if item is None:
            continue
        source = _source(item)
        if id(source) in seen:
            continue
        seen.add(id(source))
        count, problem = _drop(source, want)
        counts.append(count)
        if problem and problem not in problems:
            problems.append(problem)
    if len(set(counts)) > 1 and not problems:
        problems.append(f"the data iterators of this rank gave {sorted(set(counts))}")
    return Skip(want, min(counts, default=0), len(counts), "; ".join(problems))
