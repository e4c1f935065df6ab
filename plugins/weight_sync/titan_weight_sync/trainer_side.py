"""The trainer side: move a full set of Hugging Face named weights into SGLang engines.

One :meth:`WeightSync.sync`:

1. ``hello`` to every engine: each proves it holds the job's secret, opens its landing region
   and returns its tensor table. The weights are checked against that table before a byte moves:
   every name known, every shape equal, nothing missing.
2. The weights are packed, in table order and in the engine's dtype, into one registered
   staging buffer of bounded size (reserved in the core's host-memory ledger), and each piece is
   written one-sided into every engine's landing region over Mooncake. The engines keep serving
   meanwhile: nothing they serve is touched yet.
3. Each engine is paused (``retract``), its cache flushed, and SGLang's session opened
   (``begin_weight_update``). The ``commit``, signed over the engine's nonce, carries the
   version and every tensor's digest (BLAKE3). The engine loads only bytes that match, through
   SGLang's own loader. Then ``end_weight_update`` (post-load hooks such as re-quantization run
   there) and ``continue_generation``.

Any failure raises :class:`WeightSyncError` naming the cause. Every engine is left serving its
last complete version: its exchange aborted, its session closed, its generation resumed. The
caller (a framework's update path) then runs its own path.

The three steps are also offered one by one (:meth:`WeightSync.open`, :meth:`LandingWriter.write`,
:meth:`WeightSync.commit`), so that several trainer processes (one per pipeline stage) can write
their own part of the model into the same exchange, which one of them opens and commits
(:mod:`titan_weight_sync.staged`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from titan_plugins import host_memory
from titan_plugins.transport import auth
from titan_plugins.transport.mooncake import MooncakeEngine
from titan_weight_sync import layout, stats, wire
from titan_weight_sync.digests import ALGORITHM as DIGEST
from titan_weight_sync.engine_api import EngineAPI
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.settings import (
    STAGING_BYTES,
    WeightSyncSettings,
    job_secret,
    sync_refusal,
)
from titan_weight_sync.streaming import StreamingWriter

logger = logging.getLogger("titan_plugins.weight_sync")
T = TypeVar("T")
OWNER = "weight_sync.staging"


@dataclass
class _Target:
    """One engine during one sync."""

    api: EngineAPI
    session_id: str = ""
    landing_addr: int = 0
    landing_bytes: int = 0
    nonce: str = ""
    slots: list[layout.Slot] = field(default_factory=list)
    session: bool = True  # the engine's SGLang has begin / end_weight_update
    begun: bool = False
    paused: bool = False


@dataclass(frozen=True)
class Landing:
    """Where one engine takes the writes of an open exchange (no secret, no nonce: what any
    writing process of the job may be told)."""

    url: str
    session_id: str
    addr: int
    nbytes: int


@dataclass(frozen=True)
class Landings:
    """An open exchange: every engine's landing region and the table they share."""

    engines: tuple[Landing, ...]
    slots: tuple[layout.Slot, ...]


@dataclass
class SyncResult:
    """What one sync did."""

    version: str
    engines: int
    tensors: int
    bytes_written: int
    seconds: dict[str, float]


class LandingWriter:
    """One process's writes into open exchanges: a registered staging buffer of bounded size
    (reserved in the core's host-memory ledger, allocated at the first write) and its Mooncake
    engine. Any rank of the job can hold one."""

    def __init__(self, settings: WeightSyncSettings) -> None:
        self.settings = settings
        self._engine: MooncakeEngine | None = None
        self._staging: torch.Tensor | None = None
        self._reservation: host_memory.Reservation | None = None
        self._writer: StreamingWriter | None = None

    def _staging_buffer(self) -> tuple[MooncakeEngine, StreamingWriter]:
        if self._staging is None:
            nbytes = self.settings.staging_bytes
            reservation = host_memory.Reservation(OWNER)
            if not reservation.grow(nbytes):
                raise WeightSyncError(
                    f"weight_sync: the staging buffer ({STAGING_BYTES.name}) "
                    f"{host_memory.shortfall(nbytes)}"
                )
            try:
                engine = self._engine or MooncakeEngine(
                    self.settings,
                    who="weight_sync",
                    error=WeightSyncError,
                    hint="; check TITAN_WEIGHT_SYNC_PROTOCOL / _HOST / _DEVICE",
                )
                staging = torch.empty(
                    nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
                )
                engine.register(staging)
            except BaseException:
                reservation.close()
                raise
            self._engine, self._staging, self._reservation = engine, staging, reservation
            self._writer = StreamingWriter(staging)
        assert self._engine is not None and self._writer is not None
        return self._engine, self._writer

    def close(self) -> None:
        """Give back the staging buffer (unregistered, and released in the ledger)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._engine is not None and self._staging is not None:
            self._engine.unregister(self._staging)
        self._staging = None
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

    def write(self, landings: Landings, weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """Stream ``weights`` (any part of the model) into every engine of ``landings``; the
        digest of each tensor as sent. Refuses an unknown name or a wrong shape or dtype
        before a byte moves.

        :raises WeightSyncError: the cause (the engines still serve: nothing is committed).
        """
        slots, tensors = checked_part(weights, list(landings.slots))
        if not slots:
            return {}
        engine, writer = self._staging_buffer()

        def write_one(target: Landing, local: list[int], offsets: list[int], lengths: list[int]):
            try:
                engine.write(
                    target.session_id, local, [target.addr + offset for offset in offsets], lengths
                )
            except WeightSyncError as err:
                raise WeightSyncError(
                    f"weight_sync: writing to the engine at {target.url} failed: {err}"
                ) from None

        def write(local: list[int], offsets: list[int], lengths: list[int]) -> None:
            _each(landings.engines, lambda t: write_one(t, local, offsets, lengths))

        digests = writer.run(slots, tensors, write)
        written = sum(slot.nbytes for slot in slots) * len(landings.engines)
        stats.count("bytes_written", written)
        stats.count("tensors_written", len(slots) * len(landings.engines))
        return dict(digests)


PAUSE_MODES = ("retract", "abort", "in_place")
SELECTORS = ("all", "target", "draft")


class WeightSync:
    """The trainer's connection to a set of engines (``http://host:port`` each).

    :param engines: the engines' HTTP addresses.
    :param settings: the knobs (default: read now).
    :param pause_mode: how SGLang pauses generation for the commit (its ``pause_generation``
        modes; miles' ``--pause-generation-mode``). ``in_place`` keeps the paused requests and
        their cache: the cache is flushed after the commit only when no request is paused (SGLang
        flushes only an idle engine), as the framework's own in-place update leaves it.
    :param selector: which of the engine's models SGLang's session opens (``all``, ``target``:
        not the speculative draft, ``draft``).
    """

    def __init__(
        self,
        engines: list[str],
        settings: WeightSyncSettings | None = None,
        pause_mode: str = "retract",
        selector: str = "all",
    ) -> None:
        if not engines:
            raise WeightSyncError("weight_sync: no engine to sync into")
        if pause_mode not in PAUSE_MODES:
            raise WeightSyncError(
                f"weight_sync: pause mode {pause_mode!r} is none of SGLang's {PAUSE_MODES}"
            )
        if selector not in SELECTORS:
            raise WeightSyncError(
                f"weight_sync: selector {selector!r} is none of SGLang's {SELECTORS}"
            )
        self.pause_mode = pause_mode
        self.selector = selector
        self.settings = settings or WeightSyncSettings.read()
        self.apis = [EngineAPI(url, self.settings.timeout_s) for url in engines]
        self.writer = LandingWriter(self.settings)
        self._open: list[_Target] = []

    def close(self) -> None:
        """Give back the staging buffer (unregistered, and released in the ledger)."""
        self.writer.close()

    # ------------------------------------------------------------ one sync
    def sync(self, weights: Mapping[str, torch.Tensor], version: str) -> SyncResult:
        """Move ``weights`` (Hugging Face names, the full set the engines serve) into every
        engine, all or nothing per engine; their weight version becomes ``version``.

        :raises WeightSyncError: the cause, after every engine was left serving its last
            complete version.
        """
        seconds: dict[str, float] = {}
        started = time.perf_counter()
        landings = self.open()
        try:
            missing_check(weights, landings.slots)
            seconds["hello_s"] = time.perf_counter() - started
            mark = time.perf_counter()
            digests = self.writer.write(landings, weights)
            seconds["write_s"] = time.perf_counter() - mark
        except BaseException:
            self.abort()
            raise
        mark = time.perf_counter()
        self.commit(version, digests)
        seconds["commit_s"] = time.perf_counter() - mark
        seconds["total_s"] = time.perf_counter() - started
        written = sum(slot.nbytes for slot in landings.slots) * len(landings.engines)
        return SyncResult(version, len(landings.engines), len(landings.slots), written, seconds)

    def open(self) -> Landings:
        """``hello`` to every engine: each opens its landing region for this exchange.

        :raises WeightSyncError: the cause (every engine opened so far is aborted first).
        """
        refusal = sync_refusal()  # also where no activation read the switch (no megatron)
        if refusal:
            raise WeightSyncError(f"weight_sync: {refusal}")
        secret = self._secret()
        targets = [_Target(api) for api in self.apis]
        self._open = targets
        try:
            for target in targets:
                self._hello(secret, target)
            slots = targets[0].slots
            for target in targets[1:]:
                if target.slots != slots:
                    raise WeightSyncError(
                        f"weight_sync: {target.api.url} serves other tensors than "
                        f"{targets[0].api.url}; sync them separately"
                    )
        except BaseException:
            self.abort()
            raise
        return Landings(
            tuple(
                Landing(t.api.url, t.session_id, t.landing_addr, t.landing_bytes) for t in targets
            ),
            tuple(slots),
        )

    def commit(self, version: str, digests: Mapping[str, str]) -> None:
        """Commit the open exchange on every engine at once: ``digests`` (name -> digest, from
        every writer) must cover the whole table. Each engine loads only bytes that match.

        :raises WeightSyncError: the cause, after every engine was left serving its last
            complete version.
        """
        targets = self._open
        if not targets:
            raise WeightSyncError("weight_sync: commit without an open exchange")
        secret = self._secret()
        try:
            slots = targets[0].slots
            missing_check(digests, slots, "written")
            ordered = [(slot.name, digests[slot.name]) for slot in slots]
            _each(targets, lambda target: self._commit(secret, target, version, ordered))
        except BaseException:
            self.abort()
            raise
        self._open = []
        stats.count("syncs")
        stats.count("engines_synced", len(targets))

    def abort(self) -> None:
        """Leave every engine of the open exchange serving its last complete version: abort the
        exchange, close the session, resume generation (each best effort)."""
        targets, self._open = self._open, []
        if not targets:
            return
        stats.count("failed_syncs")
        try:
            secret = self._secret()
        except WeightSyncError as err:
            logger.warning("weight_sync: cannot abort the exchanges: %s", err)
            return
        self._leave_serving(secret, targets)

    def _secret(self) -> bytes:
        try:
            return job_secret(self.settings.secret_file)
        except auth.SecretError as err:
            raise WeightSyncError(f"weight_sync: {err}") from None

    def _hello(self, secret: bytes, target: _Target) -> None:
        trainer_nonce = auth.nonce()
        ok, text = target.api.titan(wire.hello_request(secret, trainer_nonce))
        if not ok:
            raise WeightSyncError(f"weight_sync: {target.api.url}: {text}")
        try:
            body = wire.read_hello_reply(secret, trainer_nonce, text)
            target.slots = wire.slots_field(body)
            target.nonce = wire.hex_field(body, "engine_nonce", 32)
            target.session_id = wire.text_field(body, "session_id", 300)
            session = body.get("session", True)
            if not isinstance(session, bool):
                raise wire.BadMessage("session: expected true or false")
            target.session = session
            algorithm = body.get("digest", "sha256")  # before the field, engines used SHA-256
            if algorithm != DIGEST:
                raise wire.BadMessage(
                    f"the engine checks updates with {str(algorithm)[:40]!r}, this trainer with "
                    f"{DIGEST!r}: install the same titan-weight-sync version on the "
                    "trainer and in the engine's environment"
                )
            addr, size = body.get("landing_addr"), body.get("landing_bytes")
            if not (isinstance(addr, int) and isinstance(size, int) and addr > 0 and size >= 0):
                raise wire.BadMessage("landing_addr / landing_bytes: expected integers")
        except wire.BadMessage as err:
            raise WeightSyncError(f"weight_sync: {target.api.url}: {err}") from None
        if layout.region_bytes(target.slots) > size:
            raise WeightSyncError(f"weight_sync: {target.api.url}: its table overflows its region")
        target.landing_addr, target.landing_bytes = addr, size

    def _commit(
        self, secret: bytes, target: _Target, version: str, digests: list[tuple[str, str]]
    ) -> None:
        api = target.api
        flush = self.pause_mode != "in_place"  # in place keeps the paused requests' cache
        api.require("/pause_generation", {"mode": self.pause_mode})
        target.paused = True
        if self.pause_mode == "abort" and not target.session:
            # 0.5.15.post1's abort pause ends the requests but never pauses the scheduler, which
            # loads only while paused: pause it too (after the abort nothing is left to retract)
            api.require("/pause_generation", {"mode": "retract"})
        if flush:
            api.require("/flush_cache")
        if target.session:  # an SGLang without one (0.5.15.post1) loads while paused
            api.require("/begin_weight_update", {"selector": self.selector})
            target.begun = True
        nonce, target.nonce = target.nonce, ""  # the engine closes the exchange either way
        ok, text = api.titan(
            wire.commit_request(secret, nonce, version, digests), version, flush_cache=flush
        )
        if not ok:
            raise WeightSyncError(f"weight_sync: {api.url}: {text}")
        try:
            loaded = wire.read_commit_reply(secret, nonce, version, text)
        except wire.BadMessage as err:
            raise WeightSyncError(f"weight_sync: {api.url}: {err}") from None
        if loaded != len(digests):
            raise WeightSyncError(f"weight_sync: {api.url} loaded {loaded} of {len(digests)}")
        if target.session:
            api.require("/end_weight_update")
            target.begun = False
        if not flush:
            # SGLang flushes only an idle engine: with no request paused in place, the old
            # weights' cached prefixes go now; with some, they stay until evicted (as in the
            # framework's own in-place update)
            flushed = api.call("/flush_cache")
            if flushed.get("success") is False:
                logger.info("weight_sync: %s kept its cache: %s", api.url, flushed.get("message"))
        api.require("/continue_generation")
        target.paused = False

    def _leave_serving(self, secret: bytes, targets: list[_Target]) -> None:
        """After a failure: abort open exchanges, close sessions, resume generation (each
        best effort: an engine that died needs nothing)."""
        for target in targets:
            steps = []
            if target.nonce:
                steps.append(lambda t=target: t.api.titan(wire.abort_request(secret, t.nonce)))
            if target.begun:
                steps.append(lambda t=target: t.api.call("/end_weight_update"))
            if target.paused:
                steps.append(lambda t=target: t.api.call("/continue_generation"))
            for step in steps:
                try:
                    step()
                except WeightSyncError as err:
                    logger.warning("weight_sync: leaving %s serving: %s", target.api.url, err)


def missing_check(
    names: Collection[str], slots: Sequence[layout.Slot], done: str = "given"
) -> None:
    """Refuses a full set of weights (or of digests: ``done="written"``) that lacks a tensor the
    engines serve."""
    missing = sorted({slot.name for slot in slots} - set(names))
    if missing:
        raise WeightSyncError(
            f"weight_sync: {len(missing)} tensor(s) the engines serve were not {done}: "
            f"{missing[:5]}; a sync replaces the whole model"
        )


def checked_part(
    weights: Mapping[str, torch.Tensor], slots: list[layout.Slot]
) -> tuple[list[layout.Slot], list[torch.Tensor]]:
    """The slots of ``weights`` and the tensors, in table order; refuses an unknown name, a
    wrong shape or a float given for an integer tensor (or back), by name."""
    by_name = {slot.name: slot for slot in slots}
    unknown = sorted(set(weights) - set(by_name))
    if unknown:
        raise WeightSyncError(
            f"weight_sync: the engines serve no tensor named {unknown[:5]} (their checkpoint "
            f"has {len(by_name)}); check the name conversion"
        )
    part = [slot for slot in slots if slot.name in weights]
    for slot in part:
        tensor = weights[slot.name]
        if tuple(tensor.shape) != slot.shape:
            raise WeightSyncError(
                f"weight_sync: {slot.name} has shape {tuple(tensor.shape)}; the engines "
                f"serve {slot.shape}"
            )
        if tensor.dtype.is_floating_point != layout.DTYPES[slot.dtype].is_floating_point:
            raise WeightSyncError(
                f"weight_sync: {slot.name} is {tensor.dtype}; the engines serve {slot.dtype}"
            )
    return part, [weights[slot.name] for slot in part]


def _each(targets: Sequence[T], step: Callable[[T], None]) -> None:
    """``step`` for every engine at once (engines are separate machines: one engine's load or
    write must not wait for another's); the first error is raised after all have finished."""
    if len(targets) == 1:
        step(targets[0])
        return
    with ThreadPoolExecutor(len(targets), thread_name_prefix="titan-weight-sync-engine") as pool:
        futures = [pool.submit(step, target) for target in targets]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
