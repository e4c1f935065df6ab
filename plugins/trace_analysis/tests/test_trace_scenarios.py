"""Issue 16's scenarios, each generated with ground truth and diagnosed through the CLI:
a slow stage, a slow node, collectives without args (with and without CPU titles), a truncated
straggler, ranks only in file names, other collective libraries.  Small sets (1 layer per
stage, 4 microbatches) keep each case to a few seconds.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import gen_traces
import pytest
from titan_trace_analysis import cli

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

BASE = ["--layers", "1", "--microbatches", "4", "--steps", "3"]


def _run(tmp_path: Path, gen_args: list[str], *cli_args: str) -> tuple[dict, dict, str, Path]:
    """Generate, analyse; return (generator info, report, terminal text, output folder)."""
    d, out = tmp_path / "t", tmp_path / "o"
    info = gen_traces.generate(["--out", str(d), *BASE, *gen_args])
    code, report, text = cli.run(
        cli.build_parser().parse_args(
            ["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "2", *cli_args]
        )
    )
    assert code in (cli.EXIT_OK, cli.EXIT_PARTIAL), text
    return info, json.loads((out / "report.json").read_text()), text, out


def _slow(report: dict) -> list[tuple[str, object]]:
    return [(u["unit"], u["id"]) for u in report["slow_units"] if u["verdict"] == "slow"]


def test_slow_stage_is_blamed_on_the_stage_not_its_ranks(tmp_path: Path):
    # 32 ranks = PP 4 x DP 8, expert groups of 4: stage 1's 8 ranks all at 1.3x
    info, report, text, _ = _run(
        tmp_path, ["--ranks", "32", "--ep", "4", "--slow-stages", "1", "--steps", "2"]
    )
    assert _slow(report) == [("stage", 1)]
    stage = report["slow_units"][0]
    assert stage["slowdown"] == pytest.approx(info["truth"]["slow_factor"], rel=0.05)
    assert stage["ranks"] == list(range(8, 16)) and stage["peers"] == 3
    assert report["slow_ranks"] == []  # explained by their stage
    assert "stage 1: 1.3" in text.replace("0x", "x")


def test_slow_node_is_found_from_host_names(tmp_path: Path):
    # node-3 = ranks 12-15: half of stage 1, exactly one expert group
    info, report, _, _ = _run(
        tmp_path,
        [
            "--ranks",
            "32",
            "--ep",
            "4",
            "--ranks-per-node",
            "4",
            "--slow-nodes",
            "3",
            "--steps",
            "2",
        ],
    )
    assert _slow(report) == [("node", "node-3")]
    node = report["slow_units"][0]
    assert node["ranks"] == [12, 13, 14, 15] and node["peers"] == 7
    assert node["same_as"] == [{"unit": "expert_group", "id": 12}]
    assert node["slowdown"] == pytest.approx(info["truth"]["slow_factor"], rel=0.05)


def test_slow_node_from_ranks_per_node_when_traces_have_no_host(tmp_path: Path):
    _, report, _, _ = _run(
        tmp_path, ["--ranks", "16", "--pp", "2", "--ep", "2", "--slow-ranks", "4,5,6,7"],
        "--ranks-per-node", "4",
    )  # fmt: skip
    assert _slow(report) == [("node", "ranks 4+")]


@pytest.mark.parametrize("naming", ["modern", "mccl"])
def test_collectives_without_args_are_recognised_from_cpu_titles(tmp_path: Path, naming: str):
    info, report, text, out = _run(
        tmp_path, ["--ranks", "8", "--slow-ranks", "5", "--no-collective-args",
                   "--nccl-naming", naming],
    )  # fmt: skip
    for s, t in zip(report["stages"], info["truth"]["stages"]):
        assert abs(s["bubble_ratio"] - t["stall_ratio"]) < 0.005, (s, t)
    assert [s["rank"] for s in report["slow_ranks"]] == [5]
    for st, want in zip(report["critical_path"]["steps"].values(), info["truth"]["step_time_us"]):
        assert st["length_us"] == pytest.approx(want, rel=0.02)
        assert st["unresolved_peers"] == []
    m = report["ranks"]["2"]["mean_per_step"]
    for kind in ("pp_send", "pp_recv", "ep_a2a", "dp_reduce_scatter", "dp_all_gather"):
        assert m["comm." + kind] > 0, kind
    warning = "collective args absent on ranks 0, 1, 2"
    _warned_everywhere(warning, report, text, out)


def test_kernel_names_only_pairing_is_impossible_and_said_everywhere(tmp_path: Path):
    _, report, text, out = _run(
        tmp_path, ["--ranks", "8", "--no-collective-args", "--no-annotations"]
    )
    assert all(s["bubble_ratio"] is None for s in report["stages"])  # not 0.0: unknown
    m = report["ranks"]["0"]["mean_per_step"]
    assert m["comm.p2p"] > 0 and m["comm.dp_all_gather"] > 0  # the kinds names do tell
    _warned_everywhere("P2P pairing impossible", report, text, out)
    assert "not measured" in (out / "report.html").read_text()


def _warned_everywhere(warning: str, report: dict, text: str, out: Path) -> None:
    assert any(warning in w for w in report["warnings"]), report["warnings"]
    assert warning in text.split("\n\n")[0]  # at the top of the terminal output
    html = (out / "report.html").read_text()
    assert warning in html and html.index(warning) < html.index("<h2>")
    merged = json.loads((out / "merged_trace.json").read_text())
    assert any(warning in w for w in merged["otherData"]["warnings"])


def test_truncated_straggler_is_salvaged_and_still_diagnosed(tmp_path: Path):
    d = tmp_path / "t"
    info = gen_traces.generate(["--out", str(d), *BASE, "--ranks", "8", "--slow-ranks", "5"])
    text = gzip.decompress((d / "rank-5.json.gz").read_bytes()).decode()
    (d / "rank-5.json.gz").write_bytes(gzip.compress(text[: len(text) * 4 // 5].encode()))
    out = tmp_path / "o"
    rc = cli.main(["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "2"])
    assert rc == cli.EXIT_PARTIAL
    report = json.loads((out / "report.json").read_text())
    assert report["ranks"]["5"]["partial"]
    slow = report["slow_ranks"]
    assert [s["rank"] for s in slow] == [5] and slow[0]["partial"]
    assert slow[0]["slowdown"] == pytest.approx(info["truth"]["slow_factor"], rel=0.05)
    # the step it lost: its peers' waits show it late, and the path says it needs rank 5
    late = [x for x in report["lateness"] if x["rank"] == 5]
    assert late and late[0]["verdict"].startswith("likely slow")
    lost = late[0]["steps"]
    assert lost and set(lost) < set(report["steps"])
    for k in lost:
        assert 5 in report["critical_path"]["steps"][k]["unresolved_peers"]
    assert any("rank 5 (partial): likely slow" in w for w in report["warnings"])
    for k in set(report["steps"]) - set(lost):  # the steps it kept are complete
        assert report["critical_path"]["steps"][k]["unresolved_peers"] == []


def test_ranks_from_file_names_when_the_traces_have_none(tmp_path: Path):
    d = tmp_path / "t"
    gen_traces.generate(["--out", str(d), *BASE, "--ranks", "4", "--pp", "2", "--no-rank"])
    for r in range(4):  # names without "rank": --rank-from filename takes the only number
        (d / f"rank-{r}.json.gz").rename(d / f"trace_{r:04d}.json.gz")
    out = tmp_path / "o"
    assert cli.main(["analyze", str(d), "--out", str(out), "--no-progress"]) == cli.EXIT_FAILED
    assert "--rank-from filename" in (out / "report.json").read_text()
    args = ["analyze", str(d), "--out", str(out), "--no-progress", "--rank-from", "filename"]
    assert cli.main(args) == cli.EXIT_OK
    report = json.loads((out / "report.json").read_text())
    assert sorted(report["ranks"]) == ["0", "1", "2", "3"]
    assert {r: v["coords"]["pp"] for r, v in report["ranks"].items()} == {
        "0": 0,
        "1": 0,
        "2": 1,
        "3": 1,  # coordinates from pg_config, placed by the file's rank
    }
    assert any("taken from file names" in w for w in report["warnings"])
