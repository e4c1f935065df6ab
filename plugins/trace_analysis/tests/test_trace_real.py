"""Real Kineto traces from HTA's test data (../shared/data/hta_traces, MIT; see ORIGIN.md):
they parse, summarise, and agree with HTA's temporal breakdown where HTA is right.

The expected numbers are computed here from the raw events with the stdlib JSON parser:
HTA's definition (idle = GPU span - union of all GPU work; compute = union of compute kernels;
non-compute = the rest), restricted to real GPU work (kernels, memcpy, memset: HTA also counts
``cuda_sync`` markers, which have a stream id, as compute) and with modern NCCL names
(``ncclDevKernel_*``) counted as communication (HTA 0.5.0 counts them as compute).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from titan_trace_analysis import cli
from titan_trace_analysis.summarize import summarize

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / ".." / "shared" / "data" / "hta_traces"
pytestmark = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"real HTA traces not found at {DATA} (CI copies ../shared)"
)

FILES = [
    "trace_filter/sampled_rank-0.json.gz",
    "trace_filter/sampled_rank-1.json.gz",
    "nccl_parser_config/nccl_data.json.gz",
    "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    "critical_path/alexnet/benchmark_result_2869224_1695835535_trace.json.gz",
]


def _union_length(iv: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(first start, last end, covered length) of a set of intervals."""
    iv = sorted(iv)
    covered, cur_a, cur_b = 0.0, iv[0][0], iv[0][1]
    for a, b in iv[1:]:
        if a > cur_b:
            covered += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    covered += cur_b - cur_a
    return iv[0][0], max(b for _, b in iv), covered


def _expected(path: Path) -> dict[str, float]:
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    gpu = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]

    def is_compute(e: dict) -> bool:
        name = e["name"]
        comm = name.startswith(("nccl", "rccl", "mccl")) and "Kernel" in name
        memory = e["cat"] != "kernel" or name.startswith(("Memcpy", "Memset"))
        return not comm and not memory

    first, last, busy = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if is_compute(e)]
    compute = _union_length(comp)[2] if comp else 0.0
    span = last - first
    return {
        "span_us": span,
        "idle_us": span - busy,
        "compute_us": compute,
        "non_compute_us": span - compute - (span - busy),
    }


@pytest.mark.parametrize("name", FILES)
def test_temporal_breakdown_matches_hta_definition(name: str):
    path = DATA / name
    got = summarize(str(path))
    assert got["status"] != "error", got["problems"]
    want = _expected(path)
    for key, value in want.items():
        assert got["temporal"][key] == pytest.approx(value, rel=1e-9, abs=1e-3), key
    assert got["events"] > 0


def test_nccl_kernels_are_communication_with_their_collective_kind():
    path = DATA / "nccl_parser_config/nccl_data.json.gz"
    got = summarize(str(path))
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    launched = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    steps = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    want = 0.0
    for e in events:
        if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_AllReduce"):
            t = launched.get(e["args"]["correlation"], e["ts"])
            if any(a <= t <= b for a, b in steps):
                want += e["dur"]
    ours = sum(s["comm_us"].get("dp_all_reduce", 0.0) for s in got["steps"].values())
    assert want > 0 and ours == pytest.approx(want)


def test_two_rank_real_set_is_analysed_and_missing_ranks_reported(tmp_path: Path):
    """The 2 ranks were sampled from a 128-rank job: both are analysed, the rest are missing."""
    traces = tmp_path / "traces"
    traces.mkdir()
    for i in (0, 1):
        os.symlink(DATA / f"trace_filter/sampled_rank-{i}.json.gz", traces / f"r{i}.json.gz")
    out = tmp_path / "out"
    rc = cli.main(["analyze", str(traces), "--out", str(out), "--no-progress", "--workers", "1"])
    report = json.loads((out / "report.json").read_text())
    assert report["ranks_analyzed"] == 2 and report["steps"]
    world = summarize(str(traces / "r0.json.gz"))["world_size"]
    if world > 2:
        assert rc == cli.EXIT_PARTIAL
        assert any("missing ranks 2," in p["problem"] for p in report["problems"])
    for r in ("0", "1"):
        m = report["ranks"][r]["mean_per_step"]
        assert m["compute_us"] > 0 and m["window_us"] >= m["compute_busy_us"]
