"""One sync written by several trainer processes: each pipeline stage sends its own weights.

A framework's update path (slime's ``UpdateWeightFromDistributed``) has one sending rank per
pipeline stage, each holding the Hugging Face tensors of its stage only. Gathering them on one
rank first would move the whole model twice. Here every rank of ``group`` calls
:func:`staged_sync` together:

1. The group's first rank opens the exchange (``hello`` to every engine) and broadcasts where
   each engine takes writes (:class:`~titan_weight_sync.trainer_side.Landings`: no secret, no
   nonce).
2. Every rank streams its pieces (any number of ``{name: tensor}`` parts, possibly none) into
   every engine with its own staging buffer. A rank that fails keeps consuming its pieces, so
   the collectives inside them (the framework's tensor- and expert-parallel gathers) stay in step.
3. Every rank's digests and failure are gathered; the first rank commits only when no rank
   failed and the digests cover the engines' whole table, so the update stays all or nothing
   across stages.

The outcome is the same on every rank: either every rank returns, or every rank raises the same
:class:`WeightSyncError`, and the caller can run the framework's own path collectively.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.trainer_side import Landings, LandingWriter, WeightSync


def staged_sync(
    open_sync: Callable[[], WeightSync] | None,
    writer: Callable[[], LandingWriter],
    pieces: Iterable[Mapping[str, torch.Tensor]],
    version: str,
    group: Any = None,
) -> int:
    """Sync the model whose parts the ranks of ``group`` hold; a collective of the group.

    :param open_sync: on the group's first rank, gives the engines' connection (``None``
        elsewhere); a failure there fails the sync on every rank.
    :param writer: this rank's writer (called only when the rank has something to send).
    :param pieces: this rank's parts of the model, Hugging Face names.
    :param version: the engines' weight version after the sync.
    :returns: the number of tensors this rank wrote.
    :raises WeightSyncError: on every rank, with the same message, when the sync failed; every
        engine then serves its last complete version.
    """
    stage = StagedSync(open_sync, writer, version, group)
    for piece in pieces:
        stage.send(piece)
    return stage.finish()


class StagedSync:
    """:func:`staged_sync` one step at a time, for a framework that hands its parts over in
    callbacks rather than as an iterator (miles' bucketed update). Every rank of ``group``
    makes one (a collective: the exchange opens), calls :meth:`send` for each of its parts
    (possibly none) and then :meth:`finish` (a collective: the commit).

    :raises WeightSyncError: on every rank, with the same message, when the exchange could not
        be opened (nothing was written: the caller's own path starts clean).
    """

    def __init__(
        self,
        open_sync: Callable[[], WeightSync] | None,
        writer: Callable[[], LandingWriter],
        version: str,
        group: Any = None,
    ) -> None:
        import torch.distributed as dist

        self.group = group
        self.version = version
        self.first = dist.get_rank(group) == 0
        self.root = dist.get_global_rank(group, 0) if group is not None else 0
        self._writer = writer
        self._sync: WeightSync | None = None
        self.digests: dict[str, str] = {}
        self.failure = ""
        opened: list[Any] = [None]
        if self.first:
            try:
                if open_sync is None:
                    raise WeightSyncError("weight_sync: the group's first rank has no engines")
                self._sync = open_sync()
                opened[0] = self._sync.open()
            except Exception as err:  # the other ranks wait for an answer: never leave them hanging
                opened[0] = _reason(err)
        dist.broadcast_object_list(opened, src=self.root, group=group)
        if isinstance(opened[0], str):
            raise WeightSyncError(opened[0])
        self.landings: Landings = opened[0]

    def send(self, piece: Mapping[str, torch.Tensor]) -> None:
        """Write one part of this rank's weights into every engine. Never raises: after a
        failure the rest are consumed unwritten (the framework's collectives that produce them
        must stay in step) and :meth:`finish` reports it on every rank."""
        if self.failure or not piece:
            return
        try:
            for name, digest in self._writer().write(self.landings, piece).items():
                if name in self.digests:
                    raise WeightSyncError(f"weight_sync: {name} was given twice by this rank")
                self.digests[name] = digest
        except Exception as err:
            self.failure = _reason(err)

    def finish(self) -> int:
        """Commit when every rank wrote its part (else abort); the number of tensors this rank
        wrote.

        :raises WeightSyncError: on every rank, with the same message, when the sync failed.
        """
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (self.digests, self.failure), group=self.group)
        outcome: list[Any] = [""]
        if self.first:
            assert self._sync is not None
            outcome[0] = _commit_all(self._sync, everyone, self.version)
        dist.broadcast_object_list(outcome, src=self.root, group=self.group)
        if outcome[0]:
            raise WeightSyncError(outcome[0])
        return len(self.digests)


def _commit_all(sync: WeightSync, everyone: list[Any], version: str) -> str:
    """On the first rank: commit when every rank wrote its part; else abort. The failure, or
    ``""``."""
    merged: dict[str, str] = {}
    problem = ""
    for rank, (digests, failure) in enumerate(everyone):
        if failure:
            problem = problem or f"{failure} (group rank {rank})"
        for name, digest in digests.items():
            if name in merged:
                problem = problem or f"weight_sync: {name} was written by two ranks"
            merged[name] = digest
    if problem:
        try:
            sync.abort()
        except Exception as err:  # the other ranks wait for the outcome: never raise here
            problem += f" (and leaving the engines serving failed: {_reason(err)})"
        return problem
    try:
        sync.commit(version, merged)
    except Exception as err:  # the other ranks wait for the outcome
        return _reason(err)
    return ""


def _reason(err: Exception) -> str:
    """The message a failure is reported with (an unexpected error keeps its type's name)."""
    if isinstance(err, WeightSyncError):
        return str(err)
    return f"weight_sync: {type(err).__name__}: {err}"
