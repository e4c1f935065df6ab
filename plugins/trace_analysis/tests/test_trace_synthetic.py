"""Synthetic multi-rank PP x EP x DP MoE traces with known ground truth (tools/gen_traces, an
independent model of the schedule): the injected slow rank is found at 8, 32 and 128 ranks, the
bubble per stage is within 0.5 percentage point of the simulator's own pipeline stalls, and the
cross-rank critical path is as long as the generator's step time (within 2%).  Trace sizes are
kept small (1 layer per stage, 2-3 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import gen_traces
import pytest
from titan_trace_analysis import cli
from titan_trace_analysis.analyze import analyze

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

SETS = {
    # ranks: generator arguments (slow rank placed away from the default)
    8: ["--ranks", "8", "--layers", "1", "--microbatches", "4", "--steps", "3", "--slow-ranks", "5"],
    32: ["--ranks", "32", "--layers", "1", "--microbatches", "4", "--steps", "2", "--slow-ranks", "21"],
    128: [
        "--ranks", "128", "--pp", "4", "--layers", "1", "--microbatches", "4", "--steps", "2",
        "--slow-ranks", "77", "--no-cuda-sync", "--no-fwdbwd",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> dict[int, tuple[dict, dict]]:
    """ranks -> (generator info with truth, analysis report), analysed on a 2-process pool."""
    out = {}
    for ranks, argv in SETS.items():
        root = tmp_path_factory.mktemp(f"r{ranks}")
        info = gen_traces.generate(["--out", str(root / "traces"), *argv])
        report = analyze(str(root / "traces"), str(root / "report"), workers=2, progress=False)
        out[ranks] = (info, report)
    return out


@pytest.mark.parametrize("ranks", sorted(SETS))
def test_injected_slow_rank_is_found(analysed, ranks: int):
    info, report = analysed[ranks]
    truth = info["truth"]
    assert report["ranks_analyzed"] == ranks and not report["problems"]
    flagged = report["slow_ranks"]
    assert [s["rank"] for s in flagged] == truth["slow_ranks"]
    assert flagged[0]["slowdown"] == pytest.approx(truth["slow_factor"], rel=0.05)
    assert flagged[0]["stage"] == truth["slow_ranks"][0] // info["dp"]  # rank = dp + DP * stage
    # no node, stage or group is blamed for one rank
    assert [u["unit"] for u in report["slow_units"] if u["verdict"] == "slow"] == ["rank"]


@pytest.mark.parametrize("ranks", sorted(SETS))
def test_bubble_per_stage_within_half_a_point_of_the_simulated_stalls(analysed, ranks: int):
    info, report = analysed[ranks]
    ours = [s["bubble_ratio"] for s in report["stages"]]
    truth = info["truth"]["stages"]
    assert len(ours) == info["pp"]
    for stage, (a, b) in enumerate(zip(ours, truth)):
        assert abs(a - b["stall_ratio"]) < 0.005, (stage, a, b)
    # the step windows are the device's: every rank's window equals the simulator's
    for r, row in report["ranks"].items():
        want = sum(x["window_us"] for x in info["truth"]["by_rank"][r]) / info["steps"]
        assert row["mean_per_step"]["window_us"] == pytest.approx(want, abs=0.002)  # ns rounding
    assert max(ours) > 0.1  # a 1F1B pipeline with few microbatches has real bubbles


@pytest.mark.parametrize("ranks", sorted(SETS))
def test_critical_path_length_is_the_step_time(analysed, ranks: int):
    info, report = analysed[ranks]
    steps = report["critical_path"]["steps"]
    truth = info["truth"]["step_time_us"]
    assert len(steps) == len(truth)
    for (_k, st), want in zip(sorted(steps.items()), truth):
        assert st["length_us"] == pytest.approx(want, rel=0.02)
        assert st["unresolved_peers"] == []
        # every microsecond of the path is attributed to something
        assert sum(v["us"] for v in st["by_kind"].values()) == pytest.approx(st["length_us"])


@pytest.mark.parametrize("ranks", sorted(SETS))
def test_critical_path_crosses_stages_through_matched_transfers(analysed, ranks: int):
    info, report = analysed[ranks]
    segs = report["critical_path"]["segments"]
    stage_of = {int(r): v["coords"]["pp"] for r, v in report["ranks"].items()}
    visited = {stage_of[s[0]] for s in segs}
    assert visited == set(range(info["pp"]))  # the pipeline dependency chain spans all stages
    kinds = {s[1] for s in segs}
    assert {"compute", "pp_recv", "ep_a2a"} <= kinds
    # segments are contiguous in time: each starts where the next one (in time) ends
    for a, b in zip(segs, segs[1:]):
        assert a[3] == pytest.approx(b[2], abs=1.0)


def test_slow_rank_lies_on_the_critical_path(analysed):
    info, report = analysed[32]
    slow = info["truth"]["slow_ranks"][0]
    on_path = {s[0] for s in report["critical_path"]["segments"] if s[1] == "compute"}
    assert slow in on_path


def test_legacy_nccl_names_and_cli_outputs(tmp_path: Path, capsys):
    info = gen_traces.generate(
        [
            "--out",
            str(tmp_path / "t"),
            *SETS[8][:-2],
            "--slow-ranks",
            "2",
            "--nccl-naming",
            "legacy",
        ]
    )
    rc = cli.main(["analyze", str(tmp_path / "t"), "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == cli.EXIT_OK
    text = capsys.readouterr().out
    assert "slow units" in text and "rank 2 (stage 1" in text
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [s["rank"] for s in report["slow_ranks"]] == info["truth"]["slow_ranks"]
    m = report["ranks"]["2"]["mean_per_step"]
    for kind in ("pp_send", "pp_recv", "ep_a2a", "dp_reduce_scatter", "dp_all_gather"):
        assert m["comm." + kind] > 0, kind  # ncclKernel_* names are communication too
    html = (tmp_path / "o" / "report.html").read_text()
    assert html.count("<svg") == 5 and "<script" not in html
    assert "http" not in html.replace("https://ui.perfetto.dev", "")
