"""The analyzer reads the project's own CPU runs (issue 12): traces captured through the real
capture path (the plugin's titan_train_step hook, titan.p2p titles on Megatron's P2P calls) from
the tiny MoE GPT on the shared gloo pools, PP=2 on 2 ranks and PP=2 x EP=2 on 4 ranks.

On a CPU trace, gloo collectives and the schedule's send / receive calls are communication,
compute is the training thread's leaf CPU ops between them.  What is asserted against the raw
events: every kind of traffic is recognised, the bubble of each stage is the time the training
thread spent blocked in pipeline receives (recomputed here from the titles), the critical path
is as long as the job's step and crosses both stages through pipeline transfers, and a rank
compared with its single same-stage peer gets no verdict. Both stages wait on the other at a
known point (see ``capture_task``) so that the crossing does not depend on the machine.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from titan_trace_analysis import capture, cli, summarize_dir
from titan_trace_analysis.summarize import summarize

SLOW_S = 0.02  # each first-stage forward and each last-stage backward, in seconds


def capture_task(out_dir: str, ep: int) -> str | None:
    """Train 5 iterations with PP=2 (x EP=ep) under TITAN_TRACE_STEPS=3-4 (runs in a worker).

    The first stage's forwards and the last stage's backwards each take ``SLOW_S`` longer, so
    the critical path crosses stages wherever it starts: the last stage's first receive waits
    for the first stage's first activation, and the first stage's last receive waits for the
    last stage's last backward. With one stage slowed only, which one ends the step is up to
    the machine's load, and a walk that starts on the slow stage rightly stays on it (CI:
    {1} == {0, 1} with neither slowed, {0} == {0, 1} with the first stage slowed).
    """
    import time

    from megatron.core import parallel_state as ps

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    def slow_backward(_module, _args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda _grad: time.sleep(SLOW_S))

    tiny_gpt.init_parallel(pp=2, ep=ep)
    cfg = tiny_gpt.make_config()
    chunks = tiny_gpt.build_model(cfg)
    if ps.is_pipeline_first_stage():
        chunks[0].register_forward_pre_hook(lambda *_: time.sleep(SLOW_S))
    if ps.is_pipeline_last_stage():
        chunks[-1].register_forward_hook(slow_backward)
    env = {"TITAN_TRACE_STEPS": "3-4", "TITAN_TRACE_DIR": out_dir}
    capture.reset()
    with plugin_active("trace_analysis", env):
        tiny_gpt.train(chunks, cfg, steps=5, num_microbatches=4)
        path = capture.current().path
        capture.reset()
    return path


def _recv_blocked(trace_dir: Path, rank: int, win: list[float]) -> float:
    """Time the training thread spent inside titan.p2p receive calls within ``win``."""
    with gzip.open(trace_dir / f"rank-{rank}.json.gz", "rt") as fh:
        events = json.load(fh)["traceEvents"]
    total = 0.0
    for e in events:
        if str(e.get("name", "")).startswith("titan.p2p:") and "recv" in e["name"]:
            a, b = max(e["ts"], win[0]), min(e["ts"] + e["dur"], win[1])
            total += max(0.0, b - a)
    return total


def _check_run(trace_dir: Path, out: Path, world: int) -> dict:
    rc = cli.main(["analyze", str(trace_dir), "--out", str(out), "--no-progress", "--workers", "2"])
    report = json.loads((out / "report.json").read_text())
    assert rc == cli.EXIT_OK, report["problems"]
    assert report["ranks_analyzed"] == world and report["steps"] == ["3", "4"]
    assert any(w.startswith("CPU-only trace") for w in report["warnings"])
    for r, row in report["ranks"].items():
        m = row["mean_per_step"]
        assert row["device"] == "cpu" and m["compute_us"] > 0
        assert m["comm.pp_send"] > 0 and m["comm.pp_recv"] > 0, (r, m)  # both stages do both
        assert m["comm.dp_all_reduce"] > 0  # gloo collectives on the gloo threads
        if world == 4:
            assert m["comm.ep_a2a"] > 0  # expert all-to-all over gloo
    # the bubble is the time blocked in pipeline receives (the thread cannot compute then)
    ends: dict[str, float] = {}
    for r in range(world):
        summary = summarize(str(trace_dir / f"rank-{r}.json.gz"))
        for k, st in summary["steps"].items():
            ends[k] = max(ends.get(k, 0.0), st["win"][1])
            blocked = _recv_blocked(trace_dir, r, st["win"])
            assert blocked > 0 and st["bubble_us"] == pytest.approx(blocked, rel=0.05), (r, k)
    assert all(s["bubble_ratio"] > 0.01 for s in report["stages"])
    # the critical path: as long as the step, through both stages, every microsecond attributed
    steps = report["critical_path"]["steps"]
    assert steps["4"]["length_us"] == pytest.approx(ends["4"] - ends["3"], rel=1e-6)
    for st in steps.values():
        assert sum(v["us"] for v in st["by_kind"].values()) == pytest.approx(st["length_us"])
        assert st["unresolved_peers"] == []
    segs = report["critical_path"]["segments"]
    assert {report["stage_of"][str(s[0])] for s in segs} == {0, 1}
    assert {s[1] for s in segs} & {"pp_recv", "pp_send"}
    # a rank against its single same-stage peer: never a verdict
    assert report["slow_ranks"] == []
    return report


@pytest.mark.multiprocess
def test_two_rank_cpu_run_is_analysed(gloo_pool2, tmp_path: Path):
    traces = tmp_path / "traces"
    paths = gloo_pool2.run(capture_task, str(traces), 1, timeout=300)
    assert sorted(Path(p).name for p in paths) == ["rank-0.json.gz", "rank-1.json.gz"]
    report = _check_run(traces, tmp_path / "out", 2)
    # PP=2, 4 microbatches, 1F1B: stage 0 waits for stage 1's backward, stage 1 for activations
    assert [s["stage"] for s in report["stages"]] == [0, 1]


@pytest.mark.multiprocess
def test_four_rank_cpu_run_is_analysed_and_summarised_for_the_demo(gloo_pool4, tmp_path: Path):
    traces = tmp_path / "traces"
    paths = gloo_pool4.run(capture_task, str(traces), 2, timeout=300)
    assert len([p for p in paths if p]) == 4
    _check_run(traces, tmp_path / "out", 4)
    text = summarize_dir(str(traces), str(tmp_path / "demo"))  # what the CPU demo prints
    assert text.startswith("titan-trace: 4 ranks analysed") and "pipeline bubble by stage" in text
    assert text.splitlines()[-1] == f"HTML report: {tmp_path / 'demo' / 'report.html'}"
    assert (tmp_path / "demo" / "report.html").exists()
    assert summarize_dir(str(tmp_path / "nowhere")).startswith("titan-trace:")  # never raises
