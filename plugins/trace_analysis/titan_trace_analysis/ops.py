"""Turn one trace's events into ops: compute intervals and labelled communication ops.

An op is ``Op(start, end, klass, kind, corr, key, peer, twin)``.  GPU traces: every kernel /
memcpy / memset is an op; communication kernels get their kind and peer from PyTorch's args,
else from the CPU-side title around their launch (``nccl:recv 1<-0``, ``titan.p2p:recv_forward``),
else from the kernel name, and ``sources`` counts which.  CPU-only traces (gloo): the
communication ops are the titles themselves and compute is the CPU ops of the training thread
between them.
"""

from __future__ import annotations

import hashlib
import json
import math
from bisect import bisect_right
from collections.abc import Callable
from typing import Any, NamedTuple

from .drops import MAX_DUR, MAX_TS, Drops, check, gpu_kind
from .fastpath import loads
from .header import MAX_RANKS, Identity, valid_int
from .kinds import (
    ALL_GATHER,
    ALL_REDUCE,
    COMM,
    COMPUTE,
    EP_A2A,
    MEMORY,
    P2P,
    PP_RECV,
    PP_SEND,
    REDUCE_SCATTER,
    Peer,
    comm_kind,
    kernel_class,
    title_parts,
)

GROUP_ROLE = {EP_A2A: "ep", REDUCE_SCATTER: "dp", ALL_GATHER: "dp", ALL_REDUCE: "dp"}
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class Op(NamedTuple):
    """One GPU (or, in CPU traces, CPU-thread) op; times in microseconds."""

    start: float
    end: float
    klass: int  # COMPUTE / MEMORY / COMM
    kind: str  # communication kind ("" for compute and memory)
    corr: int | None  # launch correlation id
    key: str  # collective instance key: process group (and members) or inferred group
    peer: int  # P2P peer rank, -1 when unknown
    twin: bool = False  # the send half of a batched send+recv kernel (its time counted once)
    posted: float = math.nan  # CPU traces: when the thread entered it (GPU: see the launch)


class Title(NamedTuple):
    """A CPU-side communication title (``nccl:send 0->1``, ``gloo:all_to_all``, ...)."""

    start: float
    end: float
    tid: int
    name: str


def sort_ops(ops: list[Op]) -> list[Op]:
    """``sorted(ops)``: by start, end, then the other fields, except that ops tied up to a
    correlation id only one of them has no longer raise (Python cannot order None and an int:
    a trace mixing kernels with and without a launch record, two of them at the same times,
    made the whole rank unreadable); the op without an id sorts first."""
    try:
        return sorted(ops)  # the usual case, at C speed
    except TypeError:
        return sorted(ops, key=_order)


def _order(op: Op) -> tuple:
    corr = op[4]
    return (*op[:4], corr is not None, -1 if corr is None else corr, *op[5:])


def times(ev: dict[str, Any]) -> tuple[float, float] | None:
    """(start, end) of an event, or None when :func:`drops.check` refuses it."""
    se = check(ev)
    return None if isinstance(se, str) else se


class OpBuilder:
    """Collects the ops of one rank while its events stream by."""

    def __init__(self, take: Callable | None = None, drops: Drops | None = None) -> None:
        self._take = take  # fastpath.native_take(): needed for a native reader's records
        self.drops = Drops() if drops is None else drops  # the reader's: one count per file
        self.gpu: list[Op] = []
        self.raw_comm: list[tuple[int, str, dict[str, Any]]] = []  # (index in gpu, name, args)
        self.titles: list[Title] = []
        self.names: dict[str, list[float]] = {}  # compute name -> [count, total us]
        self._klass: dict[str, int] = {}

    def batch(self, items: list[dict[str, Any] | tuple]) -> list[dict[str, Any]]:
        """Take the GPU events of one reader batch, in order; returns the other events.

        Native-scanner tuples come only with the native build, whose ``take`` runs this loop
        in C (~30k kernels per 200k-event trace; tested equal to the dicts of the Python
        reader through :meth:`gpu_event`)."""
        if self._take is not None:
            consts = (MAX_TS, MAX_DUR, COMPUTE, MEMORY, COMM, math.nan)
            rest, bad = self._take(items, self.gpu, self.names, self._klass, self.raw_comm,
                                   self.gpu_event, kernel_class, loads, Op, GPU_CATS, consts)  # fmt: skip
            for _ in range(bad):  # the scanner hands such events to Python: a safety net
                self.drops.add("times", "GPU event")
            return rest
        rest: list[dict[str, Any]] = []
        for ev in items:
            cat = ev.get("cat")
            if cat in GPU_CATS:
                self.gpu_event(ev, cat)
            else:
                rest.append(ev)
        return rest

    def gpu_event(self, ev: dict[str, Any], cat: str) -> None:
        """A kernel, memcpy or memset parsed into a dict (the reader's Python loop)."""
        se = check(ev)
        name = ev.get("name", "")
        if type(name) is not str:  # a list would not even be a dict key
            name = str(name)
        if type(se) is str:
            self.drops.add(se, gpu_kind(name, cat))
            return
        ts, end = se  # type: ignore[misc]
        k = self._klass.get(name) if cat == "kernel" else MEMORY
        if k is None:
            k = self._klass[name] = kernel_class(name, cat)
        args = ev.get("args")
        corr = args.get("correlation") if type(args) is dict else None
        if type(corr) is not int or corr < 0:
            corr = None
        if k == COMPUTE:
            acc = self.names.get(name)
            if acc is None:
                self.names[name] = [1.0, end - ts]
            else:
                acc[0] += 1.0
                acc[1] += end - ts
        elif k == COMM:
            self.raw_comm.append((len(self.gpu), name, args if type(args) is dict else {}))
        self.gpu.append(Op(ts, end, k, "", corr, "", -1))

    def title(self, ev: dict[str, Any]) -> None:
        """A communication title (its name matched the reader's filter)."""
        name = str(ev.get("name", ""))
        if title_parts(name) is None:
            return
        se = check(ev)
        if isinstance(se, str):
            self.drops.add(se, "communication title")
            return
        self.titles.append(Title(se[0], se[1], ev["tid"], name))


class Labeller:
    """Kinds, peers and group keys of communication ops for one rank."""

    def __init__(self, ident: Identity, titles: list[Title]) -> None:
        self.ident = ident
        self.sources = {"args": 0, "title": 0, "name": 0}
        self.p2p_unpaired = 0  # P2P ops whose peer is unknown
        self.by_tid: dict[int, list[Title]] = {}
        for t in sorted(titles):
            self.by_tid.setdefault(t.tid, []).append(t)
        self.starts = {tid: [t.start for t in ts] for tid, ts in self.by_tid.items()}
        self.members: dict[str, list[int] | None] = {}

    def enclosing(self, ts: float, tid: int) -> Title | None:
        """The innermost title on thread ``tid`` covering CPU time ``ts``."""
        starts = self.starts.get(tid)
        if not starts:
            return None
        i = bisect_right(starts, ts) - 1
        for j in range(i, max(-1, i - 8), -1):
            t = self.by_tid[tid][j]
            if t.start <= ts <= t.end:
                return t
        return None

    def resolve_peer(self, peer: Peer) -> int:
        """A peer spec as a rank (pipeline neighbours from the PP group), else -1."""
        if isinstance(peer, int):
            return peer if 0 <= peer < MAX_RANKS else -1
        group = self.ident.groups.get("pp")
        rank = self.ident.rank
        if peer is None or not group or rank not in group:
            return -1
        i = group.index(rank) + (1 if peer == "next" else -1)
        return group[i % len(group)] if len(group) > 1 else -1

    def inferred_key(self, kind: str) -> str:
        """Group key of a collective known without args: its kind and the inferred group (the
        same text on every member of that group)."""
        role = GROUP_ROLE.get(kind)
        members = self.ident.groups.get(role) if role else None
        if not members:
            return f"{kind}:?"
        text = ",".join(map(str, members))
        if len(text) > 200:
            text = f"{len(members)}:{hashlib.blake2s(text.encode()).hexdigest()[:16]}"
        key = f"{kind}:{role}:{text}"
        self.members.setdefault(key, members)
        return key

    def from_args(self, name: str, args: dict[str, Any], op: Op) -> list[Op] | None:
        """Ops of a kernel carrying PyTorch's collective args, else None."""
        coll = args.get("Collective name")
        if not isinstance(coll, str):
            return None
        self.sources["args"] += 1
        desc = args.get("Process Group Description")
        kind = comm_kind(name, coll, desc if isinstance(desc, str) else "")
        # Op(...) field by field: op._replace costs ~3x more, on every communication kernel
        if kind in (PP_SEND, PP_RECV):
            peer = self._peer_from_args(args)
            return [Op(op[0], op[1], op[2], kind, op[4], op[5], peer, op[7], op[8])]
        pg = args.get("Process Group Name", kind)
        key = f"{str(pg)[:64]}:{str(args.get('Process Group Ranks', ''))[:200]}"
        if key not in self.members:
            self.members[key] = self._members(args)
        return [Op(op[0], op[1], op[2], kind, op[4], key, op[6], op[7], op[8])]

    def from_title(self, title: Title, op: Op) -> list[Op]:
        """Ops of a kernel (or, in CPU traces, of the title itself) labelled by a title."""
        self.sources["title"] += 1
        out = []
        parts = title_parts(title.name) or ()
        has_recv = any(k == PP_RECV for k, _ in parts)
        for kind, peer in parts:
            if kind in (PP_SEND, PP_RECV):
                p = self.resolve_peer(peer)
                out.append(op._replace(kind=kind, peer=p, twin=kind == PP_SEND and has_recv))
            else:
                out.append(op._replace(kind=kind, key=self.inferred_key(kind)))
        return out

    def from_name(self, name: str, op: Op) -> list[Op]:
        """Ops of a kernel known by its name only."""
        self.sources["name"] += 1
        kind = comm_kind(name, "", "")
        if kind in (PP_SEND, PP_RECV, P2P):
            return [op._replace(kind=kind)]
        return [op._replace(kind=kind, key=self.inferred_key(kind))]

    def _peer_from_args(self, args: dict[str, Any]) -> int:
        for key in ("Dst Rank", "Src Rank", "dst_rank", "src_rank", "peer"):
            if key in args:
                peer = valid_int(args[key])
                return -1 if peer is None else peer
        ranks = self._members(args)
        rank = self.ident.rank
        if ranks and len(ranks) == 2 and rank in ranks:
            return ranks[0] if ranks[1] == rank else ranks[1]
        return -1

    def _members(self, args: dict[str, Any]) -> list[int] | None:
        text = args.get("Process Group Ranks")
        if isinstance(text, str) and "..." not in text and len(text) < 10_000_000:
            try:
                text = json.loads(text)
            except (ValueError, RecursionError):
                return None
        if not isinstance(text, list) or len(text) > MAX_RANKS:
            return None
        out = [r for r in map(valid_int, text) if r is not None]
        return out if len(out) == len(text) else None


def label_gpu(b: OpBuilder, lab: Labeller, launches: dict[int, tuple[float, int]]) -> list[Op]:
    """The rank's GPU ops with every communication kernel labelled."""
    ops = b.gpu
    extra: list[Op] = []
    for i, name, args in b.raw_comm:
        op = ops[i]
        got = lab.from_args(name, args, op)
        if got is None:
            launch = launches.get(op.corr) if op.corr is not None else None
            title = lab.enclosing(launch[0], launch[1]) if launch else None
            got = lab.from_title(title, op) if title else lab.from_name(name, op)
        if not got:
            got = [op._replace(kind=comm_kind(name, "", ""))]
        ops[i] = got[0]
        extra += got[1:]
    return ops + extra
