"""Trace metadata: the header Kineto writes before ``traceEvents`` and the process / thread
name events it writes after them."""

from __future__ import annotations

from typing import Any

from .catalogue import S_COMP, S_DP, S_EP, S_PP
from .config import Config
from .lanes import Lane


def header_of(cfg: Config, rank: int, world: int, pgs: list[dict[str, Any]]) -> dict[str, Any]:
    """The top-level metadata Kineto writes before ``traceEvents``."""
    info: dict[str, Any] = {
        "backend": "nccl",
        "rank": rank,
        "world_size": world,
        "pg_count": len(pgs),
        "pg_config": pgs,
        "nccl_version": "2.21.5",
    }
    if not cfg.rank_in_header:
        del info["rank"]
    gpus = cfg.ranks_per_node or 8
    header: dict[str, Any] = {
        "schemaVersion": 1,
        "deviceProperties": [
            {
                "id": i,
                "name": "NVIDIA H100 80GB HBM3",
                "totalGlobalMem": 85045346304,
                "computeMajor": 9,
                "computeMinor": 0,
                "maxThreadsPerBlock": 1024,
                "maxThreadsPerMultiprocessor": 2048,
                "regsPerBlock": 65536,
                "warpSize": 32,
                "sharedMemPerBlock": 49152,
                "numSms": 132,
                "regsPerMultiprocessor": 65536,
                "sharedMemPerBlockOptin": 232448,
                "sharedMemPerMultiprocessor": 233472,
            }
            for i in range(gpus)
        ],
        "distributedInfo": info,
        "record_shapes": 0,
    }
    if cfg.ranks_per_node:
        header["host_name"] = f"node-{rank // cfg.ranks_per_node}"
    return header


def meta_events(cfg: Config, ln: Lane) -> None:
    """Process / thread names, the profiler span and its instant markers."""
    base, add = cfg.base, ln.w.add
    for pid, labels in ((ln.pid, "CPU"), (ln.gpid, f"GPU {ln.dev}")):
        add(
            f'{{"name": "process_name", "ph": "M", "ts": {base:.3f}, "pid": {pid}, '
            '"tid": 0, "args": {"name": "python3.11"}}'
        )
        add(
            f'{{"name": "process_labels", "ph": "M", "ts": {base:.3f}, "pid": {pid}, '
            f'"tid": 0, "args": {{"labels": "{labels}"}}}}'
        )
    for st in (S_COMP, S_PP, S_EP, S_DP):
        add(
            f'{{"name": "thread_name", "ph": "M", "ts": {base:.3f}, "pid": {ln.gpid}, '
            f'"tid": {st}, "args": {{"name": "stream {st} "}}}}'
        )
    for tid, role in ((ln.tid_main, "pt_main_thread"), (ln.tid_bwd, "pt_autograd_0")):
        add(
            f'{{"name": "thread_name", "ph": "M", "ts": {base:.3f}, "pid": {ln.pid}, '
            f'"tid": {tid}, "args": {{"name": "thread {tid} ({role})"}}}}'
        )
    add(
        f'{{"ph": "X", "cat": "Trace", "ts": {base:.3f}, "dur": {ln.cpu - base:.3f}, '
        '"pid": "Spans", "tid": "PyTorch Profiler", "name": "PyTorch Profiler (0)", '
        '"args": {"Op count": 0}}'
    )
    add(
        '{"name": "Iteration Start: PyTorch Profiler", "ph": "i", "s": "g", "pid": "Traces", '
        f'"tid": "Trace PyTorch Profiler", "ts": {base:.3f}}}'
    )
    add(
        '{"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "", '
        f'"ts": {ln.cpu:.3f}}}'
    )
