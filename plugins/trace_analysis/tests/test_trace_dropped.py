"""Events with impossible values are counted per file, by reason and by kind, and listed as
problems in every output; a rank whose compute events were all dropped reads "not measured",
never a measured 0 (issue 29).

Impossible: a negative dur, a dur that is not finite or over 28 hours, a ts beyond 1e17 us or
a number beyond the double range (a 400-digit ts), no integer pid / tid.  The native scanner,
the reader's Python loop and the standard-library codec count the same.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gen_traces
import pytest
from titan_trace_analysis import cli
from titan_trace_analysis import summarize as summarize_module
from titan_trace_analysis.kinds import COMPUTE, kernel_class
from titan_trace_analysis.reader import TraceReader
from titan_trace_analysis.summarize import Options, summarize

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

BIG = "1" + "0" * 399  # a 400-digit timestamp


def _pair(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A 2-rank, 2-stage job (plain JSON) and rank 1's trace, parsed, to damage."""
    d = tmp_path / "t"
    gen_traces.generate(["--out", str(d), "--ranks", "2", "--pp", "2", "--layers", "1",
                         "--steps", "2", "--no-gzip"])  # fmt: skip
    return d, json.loads((d / "rank-1.json").read_text())


def _compute(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"]
            if e.get("cat") == "kernel" and kernel_class(e["name"], "kernel") == COMPUTE]  # fmt: skip


def _write(path: Path, trace: dict[str, Any]) -> None:
    path.write_text(json.dumps(trace).replace('"__BIG__"', BIG))


def _summaries(path: Path) -> list[dict[str, Any]]:
    """The summary by the native scanner, by the reader's Python loop, and with the standard
    library's JSON and gzip (--pure-python)."""
    orig = summarize_module.TraceReader

    def python_loop(*args: Any, **kwargs: Any) -> TraceReader:
        return orig(*args, **{**kwargs, "native": False})

    out = [summarize(str(path))]
    summarize_module.TraceReader = python_loop  # type: ignore[assignment,misc]
    try:
        out.append(summarize(str(path)))
    finally:
        summarize_module.TraceReader = orig  # type: ignore[misc]
    out.append(summarize(str(path), options=Options(pure=True)))
    for s in out:
        s.pop("timeline", None)
    return out


def test_impossible_events_are_counted_by_reason_on_every_path(tmp_path: Path, capsys):
    d, trace = _pair(tmp_path)
    kernels = _compute(trace)
    for e in kernels[0:3]:
        e["dur"] = -5
    for e in kernels[3:5]:
        e["dur"] = 1e308
    kernels[5]["ts"] = "__BIG__"
    del kernels[6]["pid"]
    kernels[7]["tid"] = None
    launch = next(e for e in trace["traceEvents"] if e.get("cat") == "cuda_runtime")
    del launch["tid"]  # a launch record without its thread: not where the fast regex looks
    _write(d / "rank-1.json", trace)

    fast, python, pure = _summaries(d / "rank-1.json")
    assert fast == python == pure
    assert fast["dropped"] == {
        "total": 9,
        "reasons": {"dur_negative": 3, "dur_range": 2, "number": 1, "ids": 3},
        "kinds": {"compute kernel": 7, "launch": 1, "GPU event": 1},
    }
    message = next(p for p in fast["problems"] if "events dropped" in p)
    for part in ("9 events dropped", "3 with a negative dur", "2 with a dur that is not finite",
                 "1 with a number beyond the double range", "3 without an integer pid and tid",
                 "7 compute kernel", "1 launch"):  # fmt: skip
        assert part in message, (part, message)
    assert "compute_not_measured" not in fast  # most of its compute is there

    out = tmp_path / "o"
    assert cli.main(["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "1"]) == 3
    printed = capsys.readouterr().out
    assert "rank-1.json: 9 events dropped" in printed
    report = json.loads((out / "report.json").read_text())
    assert any(p["problem"] == message for p in report["problems"])
    assert report["ranks"]["1"]["dropped"]["total"] == 9
    html = (out / "report.html").read_text()
    assert "9 events dropped" in html[: html.index("Pipeline bubble by stage")]


def test_a_rank_whose_compute_was_all_dropped_reads_not_measured(tmp_path: Path, capsys):
    d, trace = _pair(tmp_path)
    for e in _compute(trace):
        e["dur"] = -1.0
    _write(d / "rank-1.json", trace)
    fast, python, pure = _summaries(d / "rank-1.json")
    assert fast == python == pure
    n = len(_compute(trace))
    assert fast["compute_not_measured"].startswith(f"all {n} compute kernels were dropped")
    for st in fast["steps"].values():  # communication is measured, compute is not
        assert st["comm_busy_us"] > 0
        assert st["compute_us"] is None and st["bubble_us"] is None
        assert st["compute_idle_us"] is None and st["exposed_comm_us"] is None
    assert fast["temporal"]["compute_us"] is None

    out = tmp_path / "o"
    assert cli.main(["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "1"]) == 3
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("  rank     1"))
    assert "compute not measured" in line and "0.00" not in line
    stage = next(x for x in printed.splitlines() if x.startswith("  stage 1:"))
    assert "not measured" in stage and "0.0%" not in stage
    report = json.loads((out / "report.json").read_text())
    row = report["ranks"]["1"]
    assert row["compute_not_measured"] == fast["compute_not_measured"]
    assert "compute_us" not in row["mean_per_step"] and "bubble_ratio" not in row["mean_per_step"]
    assert row["mean_per_step"]["comm_busy_us"] > 0
    st1 = report["stages"][1]
    assert st1["bubble_ratio"] is None and st1["compute_idle_ratio"] is None
    assert "rank 1" in st1["not_measured"]
    # the critical path does not walk through a rank whose compute it cannot see
    steps = report["critical_path"]["steps"].values()
    assert all(x["rank"] != 1 for st in steps for x in st["top_ranks"])
    assert any(1 in st["unresolved_peers"] for st in steps)
    assert all(u["id"] != 1 for u in report["slow_units"])
    html = (out / "report.html").read_text()
    assert "compute not measured" in html and "rank 1: not measured" in html


def test_a_rank_whose_gpu_events_were_all_dropped_is_no_cpu_run(tmp_path: Path):
    d, trace = _pair(tmp_path)
    for e in trace["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            e.pop("tid", None)
    _write(d / "rank-1.json", trace)
    s = summarize(str(d / "rank-1.json"))
    assert s["device"] == "gpu" and "CPU-only" not in " ".join(s["notes"])
    assert s["compute_not_measured"].startswith("all ") and not s["steps"]
    assert s["temporal"]["span_us"] is None  # nothing measured, not a span of 0 ms
    assert "no GPU events left" in " ".join(s["problems"])


CPU_EVENTS = [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
     "ts": 0, "dur": 1000},
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": 1,
     "ts": 1000, "dur": 1000},  # no tid
    {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 1,
     "ts": 800, "dur": -100},
    {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 1,
     "ts": 900, "dur": 50},
] + [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10 + 100 * i,
     "dur": d}
    for i, d in enumerate([-5, float("inf"), -1])
] + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "ts": 600, "dur": 5}]  # fmt: skip


@pytest.mark.parametrize("pure", [False, True])
def test_cpu_runs_count_their_drops_and_do_not_measure_lost_compute(tmp_path: Path, pure: bool):
    path = tmp_path / "rank-0.json"
    text = json.dumps({"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": CPU_EVENTS})
    path.write_text(re.sub(r"\bInfinity\b", "1e400", text))
    s = summarize(str(path), options=Options(pure=pure))
    assert s["device"] == "cpu"
    assert s["dropped"] == {
        "total": 6,
        "reasons": {"ids": 2, "dur_negative": 3, "number": 1},
        "kinds": {"ProfilerStep": 1, "communication title": 1, "CPU op": 4},
    }
    assert s["compute_not_measured"].startswith("no CPU op of the training thread left")
    assert list(s["steps"]) == ["1"] and s["steps"]["1"]["comm_busy_us"] == 50.0
    assert s["steps"]["1"]["compute_us"] is None and s["steps"]["1"]["bubble_us"] is None


def test_a_launch_in_another_key_order_places_its_kernel(tmp_path: Path):
    """Launch records that the fast pattern does not read (ts before tid) are parsed in full
    and used (they were ignored: their kernels fell into the step of their own start)."""
    ids = {"pid": 1, "tid": 1}
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", **ids, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", **ids, "ts": 100,
         "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, **ids, "dur": 2,
         "args": {"correlation": 9}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", **ids, "ts": 120, "dur": 2,
         "args": {"correlation": 10}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 150, "dur": 10,
         "args": {"correlation": 9}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 160, "dur": 10,
         "args": {"correlation": 10}},
    ]  # fmt: skip
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": events}))
    fast, python, pure = _summaries(path)
    assert fast == python == pure
    assert fast["steps"]["1"]["win"] == [150.0, 160.0] and fast["steps"]["2"]["win"] == [
        160.0,
        170.0,
    ]
    assert "dropped" not in fast
