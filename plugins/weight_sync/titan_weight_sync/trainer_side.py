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
   version and every tensor's SHA-256. The engine loads only bytes that match, through SGLang's
   own loader. Then ``end_weight_update`` (post-load hooks such as re-quantization run there)
   and ``continue_generation``.

Any failure raises :class:`WeightSyncError` naming the cause. Every engine is left serving its
last complete version: its exchange aborted, its session closed, its generation resumed. The
caller (a framework's update path) then runs its own path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from titan_plugins import host_memory
from titan_plugins.transport import auth
from titan_plugins.transport.mooncake import MooncakeEngine
from titan_weight_sync import layout, stats, wire
from titan_weight_sync.engine_api import EngineAPI
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.settings import SECRET_FILE, STAGING_BYTES, WeightSyncSettings
from titan_weight_sync.streaming import StreamingWriter

logger = logging.getLogger("titan_plugins.weight_sync")
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
    begun: bool = False
    paused: bool = False


@dataclass
class SyncResult:
    """What one sync did."""

    version: str
    engines: int
    tensors: int
    bytes_written: int
    seconds: dict[str, float]


class WeightSync:
    """The trainer's connection to a set of engines (``http://host:port`` each).

    :param engines: the engines' HTTP addresses.
    :param settings: the knobs (default: read now).
    """

    def __init__(self, engines: list[str], settings: WeightSyncSettings | None = None) -> None:
        if not engines:
            raise WeightSyncError("weight_sync: no engine to sync into")
        self.settings = settings or WeightSyncSettings.read()
        self.apis = [EngineAPI(url, self.settings.timeout_s) for url in engines]
        self._engine: MooncakeEngine | None = None
        self._staging: torch.Tensor | None = None
        self._reservation: host_memory.Reservation | None = None
        self._writer: StreamingWriter | None = None

    # ------------------------------------------------------------ resources
    def _staging_buffer(self) -> torch.Tensor:
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
        return self._staging

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

    # ------------------------------------------------------------ one sync
    def sync(self, weights: Mapping[str, torch.Tensor], version: str) -> SyncResult:
        """Move ``weights`` (Hugging Face names, the full set the engines serve) into every
        engine, all or nothing per engine; their weight version becomes ``version``.

        :raises WeightSyncError: the cause, after every engine was left serving its last
            complete version.
        """
        secret = self._secret()
        targets = [_Target(api) for api in self.apis]
        seconds: dict[str, float] = {}
        started = time.perf_counter()
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
            tensors = self._checked(weights, slots)
            seconds["hello_s"] = time.perf_counter() - started
            mark = time.perf_counter()
            digests, written = self._write(targets, slots, tensors)
            seconds["write_s"] = time.perf_counter() - mark
            mark = time.perf_counter()
            _each(targets, lambda target: self._commit(secret, target, version, digests))
            seconds["commit_s"] = time.perf_counter() - mark
        except BaseException:
            self._leave_serving(secret, targets)
            stats.count("failed_syncs")
            raise
        seconds["total_s"] = time.perf_counter() - started
        stats.count("syncs")
        stats.count("engines_synced", len(targets))
        stats.count("bytes_written", written)
        stats.count("tensors_written", len(tensors) * len(targets))
        return SyncResult(version, len(targets), len(tensors), written, seconds)

    def _secret(self) -> bytes:
        try:
            return auth.read_secret(self.settings.secret_file, SECRET_FILE.name)
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
            addr, size = body.get("landing_addr"), body.get("landing_bytes")
            if not (isinstance(addr, int) and isinstance(size, int) and addr > 0 and size >= 0):
                raise wire.BadMessage("landing_addr / landing_bytes: expected integers")
        except wire.BadMessage as err:
            raise WeightSyncError(f"weight_sync: {target.api.url}: {err}") from None
        if layout.region_bytes(target.slots) > size:
            raise WeightSyncError(f"weight_sync: {target.api.url}: its table overflows its region")
        target.landing_addr, target.landing_bytes = addr, size

    def _checked(
        self, weights: Mapping[str, torch.Tensor], slots: list[layout.Slot]
    ) -> list[torch.Tensor]:
        """The weights in table order, in the engine's dtypes; refuses any mismatch by name."""
        known = {slot.name for slot in slots}
        unknown = sorted(set(weights) - known)
        if unknown:
            raise WeightSyncError(
                f"weight_sync: the engines serve no tensor named {unknown[:5]} (their checkpoint "
                f"has {len(known)}); check the name conversion"
            )
        missing = sorted(known - set(weights))
        if missing:
            raise WeightSyncError(
                f"weight_sync: {len(missing)} tensor(s) the engines serve were not given: "
                f"{missing[:5]}; a sync replaces the whole model"
            )
        ordered = []
        for slot in slots:
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
            ordered.append(tensor)
        return ordered

    def _write(
        self, targets: list[_Target], slots: list[layout.Slot], tensors: list[torch.Tensor]
    ) -> tuple[list[tuple[str, str]], int]:
        """Stream every tensor into every engine; the SHA-256 of each as sent."""
        self._staging_buffer()
        engine, writer = self._engine, self._writer
        assert engine is not None and writer is not None

        def write_one(target: _Target, local: list[int], offsets: list[int], lengths: list[int]):
            try:
                engine.write(
                    target.session_id,
                    local,
                    [target.landing_addr + offset for offset in offsets],
                    lengths,
                )
            except WeightSyncError as err:
                raise WeightSyncError(
                    f"weight_sync: writing to the engine at {target.api.url} failed: {err}"
                ) from None

        def write(local: list[int], offsets: list[int], lengths: list[int]) -> None:
            _each(targets, lambda target: write_one(target, local, offsets, lengths))

        digests = writer.run(slots, tensors, write)
        return digests, sum(slot.nbytes for slot in slots) * len(targets)

    def _commit(
        self, secret: bytes, target: _Target, version: str, digests: list[tuple[str, str]]
    ) -> None:
        api = target.api
        api.require("/pause_generation", {"mode": "retract"})
        target.paused = True
        api.require("/flush_cache")
        api.require("/begin_weight_update")
        target.begun = True
        nonce, target.nonce = target.nonce, ""  # the engine closes the exchange either way
        ok, text = api.titan(wire.commit_request(secret, nonce, version, digests), version)
        if not ok:
            raise WeightSyncError(f"weight_sync: {api.url}: {text}")
        try:
            loaded = wire.read_commit_reply(secret, nonce, version, text)
        except wire.BadMessage as err:
            raise WeightSyncError(f"weight_sync: {api.url}: {err}") from None
        if loaded != len(digests):
            raise WeightSyncError(f"weight_sync: {api.url} loaded {loaded} of {len(digests)}")
        api.require("/end_weight_update")
        target.begun = False
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


def _each(targets: list[_Target], step: Callable[[_Target], None]) -> None:
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
