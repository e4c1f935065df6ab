"""Session setup: pick the backend per pipeline group, exchange addresses, connect neighbours.

Every rank of the pipeline group publishes ``{"backend", "session_id", "control", "why"}`` in the
torch.distributed store and waits (bounded by ``TITAN_PP_RDMA_TIMEOUT_S``) for the others. The
group uses Mooncake only when every member can; otherwise all fall back to torch.distributed
together, so ranks never disagree on the transport. With Mooncake, each rank then opens one
authenticated control connection per neighbour (the lower rank connects to the higher rank's
listener, which is bound to the job's address and closed as soon as its neighbours are in), keyed
by the job secret from the store (``security.py``). Sessions are cached per group membership:
megatron builds a new ``P2PCommunicator`` every step, and the registered buffers must outlive it.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titan_pp_rdma import channel, security
from titan_pp_rdma.errors import PPRdmaError, PPRdmaTimeout
from titan_pp_rdma.mooncake_engine import MooncakeEngine
from titan_pp_rdma.ops import Link
from titan_pp_rdma.probe import probe_mooncake
from titan_pp_rdma.settings import PPRdmaSettings
from titan_pp_rdma.transport import MooncakeTransport

_LOCK = threading.Lock()


@dataclass
class _State:
    engine: MooncakeEngine | None = None
    engine_error: str = ""
    sessions: dict[tuple[int, ...], Session] = field(default_factory=dict)
    opened: dict[tuple[int, ...], int] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)


STATE = _State()


@dataclass
class Session:
    """The transport of one pipeline group: Mooncake, or None for torch.distributed."""

    ranks: tuple[int, ...]
    transport: MooncakeTransport | None
    why: str
    settings: PPRdmaSettings


def _engine(settings: PPRdmaSettings) -> MooncakeEngine | None:
    """The process-wide engine, created on first need; None (with the reason kept) if impossible."""
    if STATE.engine is None and not STATE.engine_error:
        probe = probe_mooncake()
        if not probe.available:
            STATE.engine_error = f"{probe.detail}; fix: {probe.fix}"
        else:
            try:
                STATE.engine = MooncakeEngine(settings)
            except Exception as exc:  # a broken NIC setup must not take the job down
                STATE.engine_error = f"Mooncake engine setup failed: {exc}"
    return STATE.engine


def _device() -> torch.device:
    try:
        from titan_plugins.platform import current_device

        return current_device()
    except ImportError:
        return torch.device("cpu")


def _store() -> Any:
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    return getter() if getter is not None else None


def _exchange(prefix: str, me: int, ranks: tuple[int, ...], record: dict, timeout_s: float, group):
    store = _store()
    if store is None:  # a torch without the private getter: a collective, unbounded in time
        gathered: list[Any] = [None] * len(ranks)
        dist.all_gather_object(gathered, record, group=group)
        return dict(zip(ranks, gathered, strict=True))
    store.set(f"{prefix}/{me}", json.dumps(record))
    keys = [f"{prefix}/{r}" for r in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # DistStoreError / RuntimeError on timeout, by torch version
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        raise PPRdmaTimeout(
            f"pp_rdma: pipeline ranks {missing} did not join the transport handshake within "
            f"{timeout_s:g} s (TITAN_PP_RDMA_TIMEOUT_S): they died, never started the pipeline "
            f"schedule, or run without the pp_rdma plugin ({exc})"
        ) from exc
    return {r: json.loads(store.get(k)) for r, k in zip(ranks, keys, strict=True)}


def open_session(pp_group: Any, settings: PPRdmaSettings | None = None) -> Session:
    """The session of ``pp_group`` (created, with the handshake, on first use)."""
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    settings = settings or PPRdmaSettings.from_env()
    with _LOCK:
        session = STATE.sessions.get(ranks)
        if session is not None and session.settings == settings:
            if session.transport is None or session.transport.error is None:
                return session
        if session is not None and session.transport is not None:
            session.transport.close()  # replaced (new knobs or after an error)
        me = dist.get_rank()
        engine = None if settings.backend == "torch" else _engine(settings)
        if settings.backend == "mooncake" and engine is None:
            raise PPRdmaError(
                f"pp_rdma: TITAN_PP_RDMA_BACKEND=mooncake but {STATE.engine_error}; "
                "unset it to fall back to torch.distributed"
            )
        # Every (re)opening of a group gets a fresh key space: all members open in the same
        # order, so the counter agrees across ranks without a collective.
        n = STATE.opened.get(ranks, 0)
        STATE.opened[ranks] = n + 1
        prefix = f"titan_pp_rdma/{'-'.join(map(str, ranks))}/{n}"
        listener = channel.open_listener(engine.host) if engine is not None else None
        try:
            if engine is not None:
                assert listener is not None
                record = {
                    "backend": "mooncake",
                    "session_id": engine.session_id,
                    "control": [engine.host, listener.getsockname()[1]],
                }
            elif settings.backend == "torch":
                record = {"backend": "torch", "why": "TITAN_PP_RDMA_BACKEND=torch"}
            else:
                record = {"backend": "torch", "why": STATE.engine_error}
            if _store() is None:  # no store to hold the job secret: the group's collective does
                record["secret"] = secrets.token_hex(32)
            records = _exchange(prefix, me, ranks, record, settings.timeout_s, pp_group)
            refusing = {
                r: rec.get("why", "") for r, rec in records.items() if rec["backend"] != "mooncake"
            }
            if refusing:
                why = "; ".join(f"rank {r}: {w}" for r, w in sorted(refusing.items()))
                session = Session(ranks, None, f"torch.distributed P2P ({why})", settings)
            else:
                assert engine is not None and listener is not None
                session = _mooncake_session(engine, listener, settings, prefix, ranks, records)
        finally:
            if listener is not None:
                listener.close()  # nothing else may connect once the neighbours are in
        STATE.sessions[ranks] = session
        STATE.last = {"backend": "mooncake" if session.transport else "torch", "why": session.why}
        return session


def _mooncake_session(
    engine: MooncakeEngine,
    listener: Any,
    settings: PPRdmaSettings,
    prefix: str,
    ranks: tuple[int, ...],
    records: dict[int, dict],
) -> Session:
    me = dist.get_rank()
    store = _store()
    if store is not None:
        secret = security.job_secret(store)
    else:
        secret = bytes.fromhex(records[min(ranks)]["secret"])
    key = security.session_key(secret, prefix)
    idx = ranks.index(me)
    peers = {ranks[(idx + d) % len(ranks)] for d in (-1, 1)} - {me}
    channels = {}
    try:
        for peer in sorted(p for p in peers if p > me):
            host, port = records[peer]["control"]
            channels[peer] = channel.connect(host, port, key, me, peer, prefix, settings.timeout_s)
        lower = {p for p in peers if p < me}
        if lower:
            channels.update(channel.accept(listener, key, me, prefix, lower, settings.timeout_s))
    except BaseException:
        for ch in channels.values():
            ch.close()
        raise
    buffers = settings.buffers
    if buffers == "auto":  # registering fresh memory is free on TCP, costly on RDMA
        buffers = "direct" if engine.protocol == "tcp" else "ring"
    transport = MooncakeTransport(
        engine,
        me,
        {p: Link(records[p]["session_id"], channels[p]) for p in peers},
        prefix,
        direct=buffers == "direct",
        timeout_s=settings.timeout_s,
        device=_device(),
        inline_bytes=settings.inline_bytes,
        spin_s=settings.spin_us * 1e-6,
    )
    why = f"mooncake {engine.protocol}, {buffers} buffers ({engine.metadata})"
    return Session(ranks, transport, why, settings)


def reset() -> None:
    """Forget every session (tests; after a failure the next schedule re-handshakes)."""
    with _LOCK:
        for session in STATE.sessions.values():
            if session.transport is not None:
                session.transport.close()
        STATE.sessions.clear()
        STATE.last = {}
