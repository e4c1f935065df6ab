"""The map step: reduce one rank's trace to a compact summary.

Returns the per-step figures the cross-rank analyses need (a few numbers per step) and writes
the rank's communication timeline (merged compute intervals + communication ops, for the
critical-path walk) to its own file, so the parent never holds all ranks' timelines.
"""

from __future__ import annotations

import json
import os
import re
from bisect import bisect_right
from typing import Any

from . import intervals as iv
from .coords import coordinates
from .kinds import (
    ALL_GATHER,
    ALL_REDUCE,
    COMM,
    COMPUTE,
    PP_RECV,
    PP_SEND,
    REDUCE_SCATTER,
    comm_kind,
    kernel_class,
)
from .reader import TraceError, TraceReader, dumps

# Collectives over large groups (data parallel): their start times travel in the summary so the
# critical path finds the last member to join without loading every member's timeline.
INDEXED = (REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE)

_STEP = re.compile(r"ProfilerStep#(\d+)")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)")


def _members(args: dict[str, Any], header: dict[str, Any]) -> list[int] | None:
    text = args.get("Process Group Ranks")
    if isinstance(text, list):
        return [int(x) for x in text]
    if isinstance(text, str) and "..." not in text:
        try:
            return [int(x) for x in json.loads(text)]
        except (ValueError, TypeError):
            pass
    name = args.get("Process Group Name")
    for pg in (header.get("distributedInfo") or {}).get("pg_config") or []:
        if isinstance(pg, dict) and str(pg.get("pg_name")) == str(name):
            return [int(x) for x in pg.get("ranks") or []]
    return None


def _peer(args: dict[str, Any], rank: int | None) -> int:
    for key in ("Dst Rank", "Src Rank", "dst_rank", "src_rank", "peer"):
        if key in args:
            return int(args[key])
    text = args.get("Process Group Ranks")
    if isinstance(text, str) and "..." not in text:
        try:
            ranks = json.loads(text)
        except ValueError:
            return -1
        if len(ranks) == 2 and rank in ranks:
            return int(ranks[0] if ranks[1] == rank else ranks[1])
    return -1


def summarize(path: str, timeline_dir: str | None = None) -> dict[str, Any]:
    """Summarise one trace file; never raises for bad input (problems go in the result)."""
    out: dict[str, Any] = {"file": path, "status": "ok", "problems": []}
    try:
        _summarize(path, timeline_dir, out)
    except TraceError as exc:
        out["status"] = "error"
        out["problems"].append(str(exc))
    except (ValueError, TypeError, KeyError) as exc:
        out["status"] = "error"
        out["problems"].append(f"malformed trace ({type(exc).__name__}: {exc})")
    return out


def _summarize(path: str, timeline_dir: str | None, out: dict[str, Any]) -> None:
    reader = TraceReader(path)
    steps: list[tuple[int, float, float]] = []
    launch: dict[int, float] = {}
    gpu: list[tuple] = []  # (start, end, class, kind, correlation, key, peer)
    klass_cache: dict[str, int] = {}
    keys: dict[str, list[int] | None] = {}
    rank: int | None = None
    header_seen = False
    for ev in reader.events():
        if not header_seen:
            header_seen = True
            rank = (reader.header.get("distributedInfo") or {}).get("rank")
        cat = ev.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            ts = float(ev["ts"])
            end = ts + float(ev.get("dur", 0.0))
            name = ev.get("name", "")
            k = klass_cache.get(name) if cat == "kernel" else 1
            if k is None:
                k = klass_cache[name] = kernel_class(name, cat)
            args = ev.get("args") or {}
            kind, key, peer = "", "", -1
            if k == COMM:
                coll = str(args.get("Collective name", ""))
                kind = comm_kind(name, coll, str(args.get("Process Group Description", "")))
                if kind in (PP_SEND, PP_RECV):
                    peer = _peer(args, rank)
                else:
                    pg = args.get("Process Group Name", kind)
                    key = f"{pg}:{args.get('Process Group Ranks', '')}"
                    if key not in keys:
                        keys[key] = _members(args, reader.header)
            gpu.append((ts, end, k, kind, args.get("correlation"), key, peer))
        elif cat == "user_annotation" or cat == "cpu_op":
            m = _STEP.match(ev.get("name", ""))
            if m:
                ts = float(ev["ts"])
                steps.append((int(m.group(1)), ts, ts + float(ev.get("dur", 0.0))))
        else:
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launch[corr] = float(ev["ts"])
    for corr, ts in reader.launches.items():
        launch[corr] = ts
    _identity(reader, path, out)
    out["events"] = reader.n_events
    if reader.bad_events:
        out["problems"].append(f"{reader.bad_events} events could not be parsed and were skipped")
    out["temporal"] = _temporal(gpu)
    if not gpu:
        out["status"] = "partial"
        out["problems"].append("no GPU events (CPU-only trace): GPU analyses skipped")
    if not steps:
        out["status"] = "partial"
        out["problems"].append(
            "no ProfilerStep#N annotations: per-step, bubble and critical-path analyses "
            "skipped; record with a torch.profiler schedule and prof.step() per iteration, "
            "or with TITAN_TRACE_STEPS"
        )
        out["steps"] = {}
        return
    steps.sort(key=lambda s: s[1])
    out["steps"], timeline = _per_step(steps, gpu, launch)
    if timeline_dir is not None and out.get("rank") is not None:
        tl_path = os.path.join(timeline_dir, f"rank-{out['rank']}.timeline.json")
        with open(tl_path, "wb") as fh:
            fh.write(dumps({"rank": out["rank"], "keys": keys, "steps": timeline}))
        out["timeline"] = tl_path


def _identity(reader: TraceReader, path: str, out: dict[str, Any]) -> None:
    rank, world, coords, problems = coordinates(reader.header)
    if rank is None:
        m = _RANK_IN_NAME.search(os.path.basename(path))
        if m:
            rank = int(m.group(1))
            problems.append("rank taken from the file name")
    out.update(rank=rank, world_size=world, coords=coords)
    out["problems"] += problems
    if problems and out["status"] == "ok":
        out["status"] = "partial"


def _temporal(gpu: list[tuple]) -> dict[str, float]:
    """HTA's temporal breakdown over the whole trace: idle / compute / non-compute."""
    if not gpu:
        return {"span_us": 0.0, "idle_us": 0.0, "compute_us": 0.0, "non_compute_us": 0.0}
    every = iv.union((g[0], g[1]) for g in gpu)
    span = every[-1][1] - every[0][0]
    idle = span - iv.length(every)
    compute = iv.length(iv.union((g[0], g[1]) for g in gpu if g[2] == COMPUTE))
    return {
        "span_us": span,
        "idle_us": idle,
        "compute_us": compute,
        "non_compute_us": span - compute - idle,
    }


def _per_step(steps, gpu, launch) -> tuple[dict[str, Any], dict[str, Any]]:
    starts = [s[1] for s in steps]
    buckets: list[list[tuple]] = [[] for _ in steps]
    for g in gpu:
        t = launch.get(g[4], g[0]) if g[4] is not None else g[0]
        i = bisect_right(starts, t) - 1
        if i >= 0 and t <= steps[i][2]:
            buckets[i].append(g)
    stats: dict[str, Any] = {}
    timeline: dict[str, Any] = {}
    for (num, s0, _s1), ops in zip(steps, buckets):
        if not ops:
            continue
        stats[str(num)], timeline[str(num)] = _one_step(s0, ops)
    return stats, timeline


def _one_step(s0: float, ops: list[tuple]) -> tuple[dict[str, Any], dict[str, Any]]:
    w0 = min(s0, min(g[0] for g in ops))
    w1 = max(g[1] for g in ops)
    window = [[w0, w1]]
    comp = iv.union((g[0], g[1]) for g in ops if g[2] == COMPUTE)
    comm = [g for g in ops if g[2] == COMM]
    comm_u = iv.union((g[0], g[1]) for g in comm)
    recv = iv.union((g[0], g[1]) for g in comm if g[3] == PP_RECV)
    by_kind: dict[str, float] = {}
    for g in comm:
        by_kind[g[3]] = by_kind.get(g[3], 0.0) + (g[1] - g[0])
    compute_busy = iv.length(comp)
    overlap = iv.overlap(comm_u, comp)
    stat = {
        "win": [w0, w1],
        "window_us": w1 - w0,
        "compute_us": sum(g[1] - g[0] for g in ops if g[2] == COMPUTE),
        "compute_busy_us": compute_busy,
        "compute_idle_us": (w1 - w0) - compute_busy,
        "comm_us": by_kind,
        "comm_busy_us": iv.length(comm_u),
        "overlap_us": overlap,
        "exposed_comm_us": iv.length(comm_u) - overlap,
        "memory_us": sum(g[1] - g[0] for g in ops if g[2] not in (COMPUTE, COMM)),
        # time the compute stream is idle while a pipeline receive is outstanding
        "bubble_us": iv.overlap(recv, window) - iv.overlap(recv, comp),
    }
    seq: dict[tuple, int] = {}
    tl_ops = []
    stat["dp_coll"] = dp_coll = []
    for g in sorted(comm):
        ident = (g[3], g[6]) if g[3] in (PP_SEND, PP_RECV) else (g[5],)
        n = seq.get(ident, 0)
        seq[ident] = n + 1
        tl_ops.append([g[3], g[0], g[1], g[5], g[6], n])
        if g[3] in INDEXED:
            dp_coll.append([g[5], n, g[0]])
    flat = [x for ab in comp for x in ab]
    return stat, {"win": [w0, w1], "comp": flat, "ops": tl_ops}
