"""A verified update loaded on every tensor-parallel rank of one SGLang engine.

With ``tp_size`` > 1 every TP rank is a scheduler process of its own, and SGLang's
``load_weights`` on each rank cuts that rank's shard out of the full Hugging Face tensor. The
trainer writes once per engine, into TP rank 0's landing region, so one copy of the update
crosses the network rather than ``tp_size``. Rank 0 alone checks it (the secret, the nonce, the
digests, whether SGLang can load now). It then tells every rank the verdict and, to load, sends
the verified bytes in buckets over the engine's own TP group: NCCL (NVLink) on GPUs, gloo on CPU.
Every rank hands each bucket to its own loader. A rank that cannot take part (no room for a
bucket) stops the load before any rank loads a byte. A rank whose loader fails makes the commit
fail on every rank, as SGLang's own ``update_weights_from_tensor`` does.

Each step is one collective that every rank enters, in the same order, for every message the
scheduler answers, so a refusal on rank 0 never leaves the others waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from titan_plugins import host_memory, platform
from titan_weight_sync import layout
from titan_weight_sync.engine_side import EngineEndpoint, Loader
from titan_weight_sync.errors import WeightSyncError

OWNER = "weight_sync.tp_bucket"
LOAD, SKIP = "load", "skip"


class TPGroup(Protocol):
    """What this module reads of SGLang's ``GroupCoordinator`` for the engine's TP group."""

    rank_in_group: int
    world_size: int
    cpu_group: Any
    device_group: Any
    device: torch.device


@dataclass(frozen=True)
class Bucket:
    """Consecutive slots sent in one broadcast: bytes ``[start, end)`` of the landing region."""

    start: int
    end: int
    slots: tuple[layout.Slot, ...]


def buckets(slots: list[layout.Slot], cap: int) -> list[Bucket]:
    """``slots`` cut into runs of at most ``cap`` bytes each (a tensor larger than ``cap`` is a
    bucket of its own)."""
    out: list[Bucket] = []
    run: list[layout.Slot] = []
    for slot in slots:
        if run and slot.offset + slot.nbytes - run[0].offset > cap:
            out.append(_bucket(run))
            run = []
        run.append(slot)
    if run:
        out.append(_bucket(run))
    return out


def _bucket(run: list[layout.Slot]) -> Bucket:
    return Bucket(run[0].offset, run[-1].offset + run[-1].nbytes, tuple(run))


def _views(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of ``buffer``, which holds bytes ``[start, end)``."""
    out = []
    for slot in bucket.slots:
        shifted = layout.Slot(slot.name, slot.dtype, slot.shape, slot.offset - bucket.start)
        out.append((slot.name, layout.view(buffer, shifted)))
    return out


def _broadcast_object(group: TPGroup, value: Any) -> Any:
    box = [value]
    torch.distributed.broadcast_object_list(box, group=group.cpu_group, group_src=0)
    return box[0]


def gather(group: TPGroup, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (a collective of the TP group)."""
    out: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(out, value, group=group.cpu_group)
    return out


class _BucketBuffer:
    """Where a rank receives (or, on a GPU, sends from) one bucket: on the engine's device,
    reserved in the host-memory ledger when that device is the CPU."""

    def __init__(self, group: TPGroup, nbytes: int) -> None:
        self.reservation = host_memory.Reservation(OWNER)
        self.tensor: torch.Tensor | None = None
        self.error = ""
        on_host = group.device.type == "cpu"
        if on_host and not self.reservation.grow(nbytes):
            self.error = f"no room for a bucket: {host_memory.shortfall(nbytes)}"
            return
        try:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        except RuntimeError as err:  # out of device memory
            self.reservation.close()
            self.error = f"no room for a bucket of {nbytes} bytes on {group.device}: {err}"

    def close(self) -> None:
        self.tensor = None
        self.reservation.close()


def _distribute(
    group: TPGroup, region: torch.Tensor | None, slots: list[layout.Slot], cap: int, load: Loader
) -> None:
    """The load every rank runs after a LOAD verdict: rank 0 sends ``region`` (the verified
    landing region) bucket by bucket, and every rank loads each bucket.

    :raises WeightSyncError: on every rank, when any rank could not load.
    """
    plan = buckets(slots, cap)
    largest = max((b.end - b.start for b in plan), default=0)
    sender_on_host = group.rank_in_group == 0 and group.device.type == "cpu"
    buffer = None if sender_on_host else _BucketBuffer(group, largest)
    try:
        ready = gather(group, buffer.error if buffer else "")
        missing = [f"TP rank {rank}: {why}" for rank, why in enumerate(ready) if why]
        if missing:
            raise WeightSyncError("; ".join(missing) + "; nothing was loaded")
        failed = ""
        for bucket in plan:
            size = bucket.end - bucket.start
            if buffer is None:  # rank 0 on CPU: send the verified region itself
                assert region is not None
                data = region[bucket.start : bucket.end]
            else:
                assert buffer.tensor is not None
                data = buffer.tensor[:size]
                if group.rank_in_group == 0:
                    assert region is not None
                    data.copy_(region[bucket.start : bucket.end])
            torch.distributed.broadcast(data, group=group.device_group, group_src=0)
            if not failed:  # a rank that failed still takes part in every broadcast
                try:
                    load(_views(data, bucket))
                except Exception as err:  # reported on every rank below
                    failed = f"{type(err).__name__}: {err}"
        errors = gather(group, failed)
        bad = [f"TP rank {rank}: {why}" for rank, why in enumerate(errors) if why]
        if bad:
            raise WeightSyncError(
                "SGLang's loader failed on " + "; ".join(bad) + "; the other ranks loaded, so "
                "the engine's ranks now hold different weights: load a checkpoint "
                "(update_weights_from_disk) or restart the engine"
            )
    finally:
        if buffer is not None:
            buffer.close()
            device = platform.device_module(group.device.type)  # cuda, musa: give it back
            if device is not None:
                device.empty_cache()


class Leader:
    """TP rank 0's side of one message: its loader sends the verdict LOAD and the buckets;
    :meth:`finish` sends SKIP when the message never reached a load (a hello, an abort, a
    refusal)."""

    def __init__(self, group: TPGroup, endpoint: EngineEndpoint, cap: int, load: Loader) -> None:
        self.group, self.endpoint, self.cap, self._load = group, endpoint, cap, load
        self.sent = False
        self.loaded = False  # every rank loaded the update

    def load(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """The endpoint's loader on rank 0, called with the verified landing region's tensors."""
        landing = self.endpoint.landing
        slots = self.endpoint.slots
        if landing is None or [name for name, _ in named] != [slot.name for slot in slots]:
            raise WeightSyncError("the verified tensors are not the engine's table, in order")
        self.sent = True
        _broadcast_object(self.group, (LOAD, self.cap))  # rank 0's bucket size rules
        _distribute(self.group, landing.region, slots, self.cap, self._load)
        self.loaded = True
        return len(named)

    def finish(self) -> None:
        """Release the other ranks when no load was sent for this message."""
        if not self.sent:
            self.sent = True
            _broadcast_object(self.group, SKIP)


def follow(group: TPGroup, slots: list[layout.Slot], load: Loader) -> bool:
    """A TP rank other than 0: wait for rank 0's verdict and, on LOAD, load every bucket.

    :returns: whether this message loaded an update on every rank (False for a SKIP).
    :raises WeightSyncError: the load failed on some rank (the same on every rank).
    """
    verdict = _broadcast_object(group, None)
    if verdict == SKIP:
        return False
    _, cap = verdict
    _distribute(group, None, slots, cap, load)
    return True
