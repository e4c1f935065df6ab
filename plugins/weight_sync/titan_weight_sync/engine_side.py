"""The engine side, in each SGLang scheduler process: a landing region the trainer writes into,
and the checks that decide whether SGLang loads it.

One exchange: ``hello`` (an authentic trainer) registers the landing region with Mooncake and
returns a fresh nonce; the trainer writes every tensor one-sided into its slot; ``commit``
(signed over that nonce) first takes the region off Mooncake, so no peer can write into it any
more, then compares each slot's digest (BLAKE3) with the trainer's, and only when every byte is
the trainer's hands the tensors to SGLang's own loader, inside SGLang's weight-update session. So
the served model changes only by a complete, authentic update: a half-written, forged, replayed
or corrupted one is refused with its reason, and the engine serves the last complete version.

The region holds one copy of the checkpoint in host memory (pinned where a GPU is present),
reserved in the core's host-memory ledger, allocated at the first hello (an engine no trainer
talks to pays nothing) and given back when the process ends.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from titan_plugins import host_memory
from titan_plugins.transport import auth
from titan_plugins.transport.mooncake import MooncakeEngine
from titan_weight_sync import layout, stats, wire
from titan_weight_sync.digests import ALGORITHM, digest_all, require
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.settings import WeightSyncSettings, job_secret

logger = logging.getLogger("titan_plugins.weight_sync")
OWNER = "weight_sync.landing"
SEEN_NONCES = 4096
Loader = Callable[[list[tuple[str, torch.Tensor]]], int]


class Refused(Exception):
    """A message the engine answers with a refusal (the text is the reason; ``op`` the message's
    op, empty when it could not be read)."""

    def __init__(self, reason: str, op: str = "") -> None:
        super().__init__(reason)
        self.op = op


class Landing:
    """The registered landing region of one engine."""

    def __init__(self, slots: list[layout.Slot], settings: WeightSyncSettings) -> None:
        nbytes = layout.region_bytes(slots)
        self.reservation = host_memory.Reservation(OWNER)
        try:
            if not self.reservation.grow(nbytes):
                raise WeightSyncError(
                    f"weight_sync: the engine's landing region {host_memory.shortfall(nbytes)}"
                )
            pinned = torch.cuda.is_available()
            self.region = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self.engine = MooncakeEngine(
                settings,
                who="weight_sync",
                error=WeightSyncError,
                hint="; check TITAN_WEIGHT_SYNC_PROTOCOL / _HOST / _DEVICE",
            )
        except BaseException:
            self.reservation.close()  # the memory goes back to the ledger
            raise
        self.is_open = False

    def open(self) -> None:
        """Let trainers write (register the region with Mooncake)."""
        if not self.is_open:
            self.engine.register(self.region)
            self.is_open = True

    def close(self) -> None:
        """Refuse every write from now on (Mooncake rejects writes outside registered memory)."""
        if self.is_open:
            self.engine.unregister(self.region)
            self.is_open = False


class EngineEndpoint:
    """What answers trainers in one scheduler process.

    :param model_dir: the local checkpoint the engine serves (its tensor table is the contract).
    :param settings: this process's knobs.
    :param session: whether this SGLang has a weight-update session (``begin_weight_update`` /
        ``end_weight_update``, 0.5.23); the hello tells the trainer, which then opens it (an
        SGLang without one, 0.5.15.post1, is only paused for the commit).
    """

    def __init__(
        self, model_dir: str, settings: WeightSyncSettings | None = None, session: bool = True
    ) -> None:
        self.settings = settings or WeightSyncSettings.read()
        self.session = session
        self.slots = layout.checkpoint_table(model_dir)
        self.landing: Landing | None = None
        self.nonce: str | None = None  # the engine nonce of the open exchange
        self._seen: OrderedDict[str, None] = OrderedDict()  # trainer nonces already answered

    def _secret(self, op: str) -> bytes:
        try:
            return job_secret(self.settings.secret_file)
        except auth.SecretError as err:
            raise Refused(f"this engine accepts no trainer: {err}", op) from None

    def handle(self, raw: object, load: Loader, not_ready: str = "") -> tuple[str, str]:
        """Answer one message: ``(its op, the reply)``; ``load`` hands verified tensors to SGLang
        (inside its session). ``not_ready``: why SGLang cannot load now (no session open, or
        generation not paused); a commit is then refused with it.

        :raises Refused: the message is refused (nothing changed but a closed region).
        """
        op = ""
        try:
            message = wire.decode(raw)
            op = message["op"]
            secret = self._secret(op)
            if op == "hello":
                return op, self._hello(secret, message)
            if op == "commit":
                return op, self._commit(secret, message, not_ready, load)
            self._abort(secret, message)
            return op, wire.canonical({wire.REPLY_KEY: {"aborted": True}}).decode()
        except wire.BadMessage as err:
            stats.count("refused")
            raise Refused(str(err), op) from None

    def _hello(self, secret: bytes, message: dict) -> str:
        trainer_nonce = wire.read_hello(secret, message)
        if trainer_nonce in self._seen:
            raise wire.BadMessage("hello replayed (its nonce was answered before): refused")
        self._seen[trainer_nonce] = None
        while len(self._seen) > SEEN_NONCES:
            self._seen.popitem(last=False)
        require()  # refuse now what a commit could not check
        if self.landing is None:
            self.landing = Landing(self.slots, self.settings)
        self.landing.open()
        self.nonce = auth.nonce()
        stats.count("hellos")
        body = {
            "session_id": self.landing.engine.session_id,
            "landing_addr": self.landing.region.data_ptr(),
            "landing_bytes": self.landing.region.numel(),
            "slots": [[s.name, s.dtype, list(s.shape), s.offset] for s in self.slots],
            "engine_nonce": self.nonce,
            "session": self.session,
            "digest": ALGORITHM,
        }
        return wire.hello_reply(secret, trainer_nonce, body)

    def _close_exchange(self) -> None:
        self.nonce = None
        if self.landing is not None:
            self.landing.close()

    def _commit(self, secret: bytes, message: dict, not_ready: str, load: Loader) -> str:
        if self.nonce is None or self.landing is None:
            raise wire.BadMessage("commit without a hello: refused")
        nonce = self.nonce
        version, digests = wire.read_commit(secret, nonce, message)
        self._close_exchange()  # authentic: from here no peer can write into the region
        if not_ready:
            raise wire.BadMessage(f"commit refused: {not_ready}")
        names = [name for name, _ in digests]
        expected = [slot.name for slot in self.slots]
        if names != expected:
            missing = sorted(set(expected) - set(names))[:5]
            unknown = sorted(set(names) - set(expected))[:5]
            raise wire.BadMessage(
                f"the commit does not list the engine's tensors in order (missing {missing}, "
                f"unknown {unknown})"
            )
        views = [layout.view(self.landing.region, slot) for slot in self.slots]
        landed = digest_all(views)
        wrong = [name for (name, want), got in zip(digests, landed) if want != got]
        if wrong:
            stats.count("refused_digest")
            raise wire.BadMessage(
                f"{len(wrong)} tensor(s) differ from what the trainer wrote ({', '.join(wrong[:3])}"
                "...): an incomplete write, or a write from another peer; nothing was loaded"
            )
        loaded = load(list(zip(expected, views)))
        stats.count("commits")
        stats.count("tensors_loaded", loaded)
        stats.count("bytes_loaded", sum(slot.nbytes for slot in self.slots))
        return wire.commit_reply(secret, nonce, version, loaded)

    def _abort(self, secret: bytes, message: dict) -> None:
        if self.nonce is None:
            raise wire.BadMessage("abort without an open exchange")
        wire.read_abort(secret, self.nonce, message)
        self._close_exchange()
        stats.count("aborts")
