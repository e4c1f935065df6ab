"""The map step: reduce one rank's trace to a compact summary.

Returns the per-step figures the cross-rank analyses need (a few numbers per step), compute
time per kernel name (for work-normalised slowness), and writes the rank's timeline (compute
intervals + communication ops, for the critical path) to its own file, named by the file's
position in the input list (never by anything read from the trace).  Never raises: whatever
goes wrong with a file is reported as that file's problem.  Events with impossible values are
dropped and counted (``dropped``); a rank whose compute events were all dropped has
``compute_not_measured`` (the reason) and None for every compute-derived figure, never 0.
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
from .drops import Drops, check, ts_of, valid_id
from .fastpath import native_take
from .header import Identity, identity
from .kinds import COMPUTE
from .ops import Labeller, OpBuilder, label_gpu
from .reader import MAX_EVENT, MAX_STRING, TraceError, TraceReader
from .safe import finite, safe_text
from .steps import Step, hta_window, per_step, temporal

STEP = re.compile(r"ProfilerStep#(\d{1,12})$")
TOP_NAMES = 64  # compute names kept per rank for the work-normalised comparison
MAX_GROUP = 256  # group member lists carried in the summary (larger groups: timelines only)
LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "musa_runtime", "musa_driver")
# per-step figures that need the compute ops (None where those were all dropped)
COMPUTE_FIGURES = ("compute_us", "compute_busy_us", "compute_idle_us", "overlap_us",
                   "exposed_comm_us", "bubble_us")  # fmt: skip


@dataclass(frozen=True)
class Options:
    """How the map step reads a file."""

    pure: bool = False  # standard-library JSON and gzip instead of orjson / ISA-L
    rank_from: str = "auto"  # auto | header | filename
    window: str = "trace"  # trace | hta (temporal breakdown and steps as HTA 0.5.0 counts)
    max_event_bytes: int = MAX_EVENT  # one event's text (--max-event-mb)
    max_string_bytes: int = MAX_STRING  # one string in a parsed event (--max-string-mb)


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
    except MemoryError:  # its message is empty: say what ran out
        out["status"] = "error"
        out["problems"].append(
            "out of memory reading this file (a memory limit on the process?); lower "
            "--max-event-mb / --max-string-mb or --workers; the other files are analysed"
        )
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


def _reader(path: str, opts: Options, cpu_ops: bool = False) -> TraceReader:
    return TraceReader(path, pure=opts.pure, cpu_ops=cpu_ops, max_event=opts.max_event_bytes,
                       max_string=opts.max_string_bytes)  # fmt: skip


def _read(path: str, opts: Options) -> tuple[TraceReader, OpBuilder, list[Step], set[int]]:
    reader = _reader(path, opts)
    b = OpBuilder(native_take(opts.pure) if reader.native else None, reader.drops)
    steps: dict[int, Step] = {}
    threads: set[int] = set()
    for ev in (ev for batch in reader.records() for ev in b.batch(batch)):  # GPU events taken
        cat = ev.get("cat")
        if cat in LAUNCH_CATS:  # one the fast pattern did not read (another key order)
            _launch(ev, reader.launches, reader.drops)
            continue
        name = ev.get("name")
        if not isinstance(name, str):
            continue
        if cat not in ("user_annotation", "cpu_op"):
            continue  # e.g. the GPU-side copy of a ProfilerStep (gpu_user_annotation)
        m = STEP.match(name)
        if m is None:
            b.title(ev)
            continue
        se = check(ev)
        if isinstance(se, str):
            reader.drops.add(se, "ProfilerStep")
            continue
        steps.setdefault(int(m.group(1)), (int(m.group(1)), se[0], se[1]))
        threads.add(ev["tid"])
    return reader, b, sorted(steps.values(), key=lambda s: s[1]), threads


def _launch(ev: dict[str, Any], launches: dict[int, tuple[float, int]], drops: Drops) -> None:
    """A launch record parsed in full: (CPU time, thread) by correlation, as the fast pattern
    reads Kineto's layout; one without a correlation id launches nothing we can pair."""
    args = ev.get("args")
    corr = args.get("correlation") if type(args) is dict else None
    if type(corr) is not int or corr < 0:
        return
    ts, tid = ts_of(ev.get("ts")), ev.get("tid")
    if isinstance(ts, str) or not valid_id(tid):
        drops.add(ts if isinstance(ts, str) else "ids", "launch")
        return
    launches[corr] = (ts, tid)


def _summarize(
    path: str, timeline_dir: str | None, index: int, opts: Options, out: dict[str, Any]
) -> None:
    reader, b, steps, threads = _read(path, opts)
    ident = identity(reader.header, os.path.basename(path), opts.rank_from)
    _identity(ident, out)
    out["events"] = reader.n_events
    lab = Labeller(ident, b.titles)
    launches = reader.launches
    drops = reader.drops
    gpu = bool(b.gpu) or drops.gpu() > 0  # GPU events all dropped: still no CPU run
    out["device"] = "gpu" if gpu else "cpu"
    if b.gpu:
        ops = label_gpu(b, lab, launches)
        names = b.names
    elif steps and not gpu:  # a CPU-only run (gloo): read the training thread's CPU ops too
        cpu_reader = _reader(path, opts, cpu_ops=True)
        second = Drops()
        ops, names = cpu_ops(cpu_reader.events(), b.titles, lab, threads, second)
        drops.merge(second, ("CPU op",))
        drops.merge(cpu_reader.drops, ("CPU op",))  # the first pass did not read CPU ops
        launches = {}
        out["notes"].append("CPU-only trace: compute = training-thread CPU ops, communication = "
                            "gloo / schedule titles")  # fmt: skip
    else:
        ops, names = [], {}
    if drops.total():
        out["dropped"] = drops.summary()
        out["problems"].append(drops.message())
    lost = _compute_lost(gpu, ops, b, drops)
    gpu_ops = ops if gpu else []
    out["temporal"] = _temporal(gpu_ops, lost, drops)
    if opts.window == "hta":
        out["temporal_hta"] = _temporal(hta_window(gpu_ops, steps, launches), lost, drops)
    out["names"] = dict(sorted(names.items(), key=lambda kv: -kv[1][1])[:TOP_NAMES])
    out["comm_sources"] = dict(lab.sources)
    if reader.truncated:
        out["truncated"] = True
        out["problems"].append(
            f"{reader.damage}: salvaged up to the last complete event (a step cut short is "
            "dropped); the rank is marked partial"
        )
    if not ops and gpu:
        left = " left (the others were dropped, see above)" if drops.gpu() else ""
        out["problems"].append(f"no GPU events{left}: per-step analyses skipped")
    if lost:
        out["compute_not_measured"] = lost
        out["problems"].append(
            f"compute not measured: {lost}; its compute, idle time, bubble and slowness are "
            "not reported, and the critical path does not cross this rank"
        )
    if not steps:
        left = " left (the others were dropped, see above)" if drops.kinds["ProfilerStep"] else ""
        out["problems"].append(
            f"no ProfilerStep#N annotations{left}: per-step, bubble and critical-path analyses "
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
    if lost:  # figures built without the compute ops would read as measured zeros
        for st in stats.values():
            st.update(dict.fromkeys(COMPUTE_FIGURES))
    out["steps"] = stats
    if out["problems"] and out["status"] == "ok":
        out["status"] = "partial"
    if timeline_dir is not None and timeline and ident.rank is not None and not lost:
        tl_path = os.path.join(timeline_dir, f"tl-{index}{timeline_file.SUFFIX}")
        # internal file; its times come from validated (finite) inputs
        timeline_file.write(tl_path, ident.rank, lab.members, timeline)
        out["timeline"] = tl_path


def _compute_lost(gpu: bool, ops: list, b: OpBuilder, drops: Drops) -> str | None:
    """Why the rank's compute is not measured (its compute events were all dropped), or None."""
    if gpu:
        if any(acc[0] for acc in b.names.values()):
            return None
        n = drops.kinds["compute kernel"]
        if n:
            return f"all {n} compute kernels were dropped ({drops.reasons_of('compute kernel')})"
        n = drops.gpu()
        return f"no compute kernel left ({n} GPU events were dropped unread)" if n else None
    n = drops.kinds["CPU op"]
    if not n or any(o.klass == COMPUTE for o in ops):
        return None
    return (
        f"no CPU op of the training thread left ({n} CPU ops dropped: {drops.reasons_of('CPU op')})"
    )


def _temporal(ops: list, lost: str | None, drops: Drops) -> dict[str, float | None]:
    """The temporal breakdown, with None for what the dropped events leave unknown."""
    out: dict[str, float | None] = dict(temporal(ops))
    if lost:
        out.update(compute_us=None, idle_us=None, non_compute_us=None)
    if not ops and drops.gpu():
        out["span_us"] = None
    return out


def _identity(ident: Identity, out: dict[str, Any]) -> None:
    out.update(rank=ident.rank, world_size=ident.world_size, coords=ident.coords)
    out["host"] = ident.host
    out["rank_source"] = ident.rank_source
    out["groups"] = {k: v for k, v in ident.groups.items() if len(v) <= MAX_GROUP}
    out["problems"] += ident.problems
    if ident.rank_source != "header" and ident.rank is not None:
        out["notes"].append(f"rank {ident.rank} taken from the {ident.rank_source}")
