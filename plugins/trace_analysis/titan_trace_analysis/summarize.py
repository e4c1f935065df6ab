"""The map step: reduce one rank's trace to a compact summary.

Returns the per-step figures the cross-rank analyses need (a few numbers per step), compute
time per kernel name (for work-normalised slowness), and writes the rank's timeline (compute
intervals + communication ops, for the critical path) to its own file, named by the file's
position in the input list (never by anything read from the trace).  Never raises: whatever
goes wrong with a file is reported as that file's problem.
"""

from __future__ import annotations

import gc
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from . import timeline_file
from .cpu_trace import cpu_ops
from .fastpath import native_take
from .header import Identity, identity
from .ops import Labeller, OpBuilder, label_gpu, times
from .reader import TraceError, TraceReader
from .safe import finite, safe_text
from .steps import Step, hta_window, per_step, temporal

STEP = re.compile(r"ProfilerStep#(\d{1,12})$")
TOP_NAMES = 64  # compute names kept per rank for the work-normalised comparison
MAX_GROUP = 256  # group member lists carried in the summary (larger groups: timelines only)


@dataclass(frozen=True)
class Options:
    """How the map step reads a file."""

    pure: bool = False  # standard-library JSON and gzip instead of orjson / ISA-L
    rank_from: str = "auto"  # auto | header | filename
    window: str = "trace"  # trace | hta (temporal breakdown and steps as HTA 0.5.0 counts)


def summarize(
    path: str, timeline_dir: str | None = None, index: int = 0, options: Options | None = None
) -> dict[str, Any]:
    """Summarise one trace file; never raises (problems go in the result)."""
    out: dict[str, Any] = {"file": path, "index": index, "status": "ok", "problems": []}
    out["notes"] = []
    _pause_gc()
    try:
        _summarize(path, timeline_dir, index, options or Options(), out)
    except TraceError as exc:
        out["status"] = "error"
        out["problems"].append(str(exc))
    except Exception as exc:  # any malformed input (RecursionError included) stays this file's
        out["status"] = "error"
        msg = safe_text(f"{type(exc).__name__}: {exc}", 200)
        out["problems"].append(f"unreadable trace ({msg}); the other files are analysed")
    finally:
        _resume_gc()
    return finite(out)


# The map step makes ~100k small containers that never form cycles (refcounting frees them);
# the cyclic collector would walk them again and again: ~12% of the CPU here. The collector is
# process-wide: summaries running in several threads share one pause, and the last to finish
# restores what was there before the first began.
_GC_LOCK = threading.Lock()
_gc_state = {"active": 0, "was_enabled": False}


def _pause_gc() -> None:
    with _GC_LOCK:
        if _gc_state["active"] == 0:
            _gc_state["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_state["active"] += 1


def _resume_gc() -> None:
    with _GC_LOCK:
        _gc_state["active"] -= 1
        if _gc_state["active"] == 0 and _gc_state["was_enabled"]:
            gc.enable()


def _read(path: str, opts: Options) -> tuple[TraceReader, OpBuilder, list[Step], set[int]]:
    reader = TraceReader(path, pure=opts.pure)
    b = OpBuilder(native_take(opts.pure) if reader.native else None)
    steps: dict[int, Step] = {}
    threads: set[int] = set()
    for ev in (ev for batch in reader.records() for ev in b.batch(batch)):  # GPU events taken
        cat = ev.get("cat")
        name = ev.get("name")
        if not isinstance(name, str):
            continue
        if cat not in ("user_annotation", "cpu_op"):
            continue  # e.g. the GPU-side copy of a ProfilerStep (gpu_user_annotation)
        m = STEP.match(name)
        if m is None:
            b.title(ev)
            continue
        se = times(ev)
        if se is None:
            b.bad_times += 1
            continue
        steps.setdefault(int(m.group(1)), (int(m.group(1)), se[0], se[1]))
        if isinstance(ev.get("tid"), int):
            threads.add(ev["tid"])
    return reader, b, sorted(steps.values(), key=lambda s: s[1]), threads


def _summarize(
    path: str, timeline_dir: str | None, index: int, opts: Options, out: dict[str, Any]
) -> None:
    reader, b, steps, threads = _read(path, opts)
    ident = identity(reader.header, os.path.basename(path), opts.rank_from)
    _identity(ident, out)
    out["events"] = reader.n_events
    lab = Labeller(ident, b.titles)
    launches = reader.launches
    out["device"] = "gpu" if b.gpu else "cpu"
    if b.gpu:
        ops = label_gpu(b, lab, launches)
        names = b.names
    elif steps:  # a CPU-only run (gloo): read the training thread's CPU ops too
        cpu_reader = TraceReader(path, pure=opts.pure, cpu_ops=True)
        events = (ev for ev in cpu_reader.events() if ev.get("tid") in threads)
        ops, names = cpu_ops(events, b.titles, lab, threads)
        launches = {}
        out["notes"].append("CPU-only trace: compute = training-thread CPU ops, communication = "
                            "gloo / schedule titles")  # fmt: skip
    else:
        ops, names = [], {}
    if reader.bad_events or b.bad_times:
        out["problems"].append(
            f"{reader.bad_events + b.bad_times} events skipped (unparsable, or non-finite / "
            "absurd timestamps)"
        )
    gpu_ops = ops if b.gpu else []
    out["temporal"] = temporal(gpu_ops)
    if opts.window == "hta":
        out["temporal_hta"] = temporal(hta_window(gpu_ops, steps, launches))
    out["names"] = dict(sorted(names.items(), key=lambda kv: -kv[1][1])[:TOP_NAMES])
    out["comm_sources"] = dict(lab.sources)
    if reader.truncated:
        out["truncated"] = True
        out["problems"].append(
            f"{reader.damage}: salvaged up to the last complete event (a step cut short is "
            "dropped); the rank is marked partial"
        )
    if not ops and out["device"] == "gpu":
        out["problems"].append("no GPU events: per-step analyses skipped")
    if not steps:
        out["problems"].append(
            "no ProfilerStep#N annotations: per-step, bubble and critical-path analyses "
            "skipped; record with a torch.profiler schedule and prof.step() per iteration, "
            "or with TITAN_TRACE_STEPS"
        )
    if opts.window == "hta" and len(steps) >= 2:
        steps = steps[:-1]  # HTA 0.5.0 drops the last profiled step
    stats, timeline = per_step(steps, ops, launches)
    if reader.truncated and ops:
        # the file was cut: a step still running at the last op read is incomplete
        cut = max(o.start for o in ops)
        for k in [k for k, st in stats.items() if st["win"][1] >= cut]:
            stats.pop(k)
            timeline.pop(k)
    out["steps"] = stats
    if out["problems"] and out["status"] == "ok":
        out["status"] = "partial"
    if timeline_dir is not None and timeline and ident.rank is not None:
        tl_path = os.path.join(timeline_dir, f"tl-{index}{timeline_file.SUFFIX}")
        # internal file; its times come from validated (finite) inputs
        timeline_file.write(tl_path, ident.rank, lab.members, timeline)
        out["timeline"] = tl_path


def _identity(ident: Identity, out: dict[str, Any]) -> None:
    out.update(rank=ident.rank, world_size=ident.world_size, coords=ident.coords)
    out["host"] = ident.host
    out["rank_source"] = ident.rank_source
    out["groups"] = {k: v for k, v in ident.groups.items() if len(v) <= MAX_GROUP}
    out["problems"] += ident.problems
    if ident.rank_source != "header" and ident.rank is not None:
        out["notes"].append(f"rank {ident.rank} taken from the {ident.rank_source}")
