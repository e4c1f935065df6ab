"""Capture: TITAN_TRACE_STEPS makes unmodified megatron-core schedules record one Kineto trace
per rank, with the rank's parallel coordinates in the trace metadata.

The megatron test trains the tiny MoE GPT with PP=2 on the shared 2-process gloo pool through
``get_forward_backward_func()`` (the patched schedule); the unit tests drive the same wrapper
in-process with a stand-in schedule function (no megatron) to cover the step window logic.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from titan_trace_analysis import capture
from titan_trace_analysis.summarize import summarize


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def _steps(trace: dict) -> list[str]:
    return sorted(
        e["name"]
        for e in trace["traceEvents"]
        if str(e.get("name", "")).startswith("ProfilerStep#")
    )


def megatron_capture_task(out_dir: str) -> dict:
    """Train 4 iterations with PP=2 under TITAN_TRACE_STEPS=2-3; return what the capture did."""
    from titan_plugins.testing import plugin_active, tiny_gpt

    tiny_gpt.init_parallel(pp=2)
    cfg = tiny_gpt.make_config()
    chunks = tiny_gpt.build_model(cfg)
    env = {"TITAN_TRACE_STEPS": "2-3", "TITAN_TRACE_DIR": out_dir}
    capture.reset()
    with plugin_active("trace_analysis", env) as engine:
        status = {p.id: p.status for p in engine.patches() if p.id.startswith("trace_analysis.")}
        tiny_gpt.train(chunks, cfg, steps=4, num_microbatches=2)
        path = capture.current().path
        capture.reset()
    return {"status": status, "path": path, "coords": capture.parallel_coordinates()}


@pytest.mark.multiprocess
def test_megatron_run_writes_one_trace_per_rank_with_coordinates(gloo_pool2, tmp_path: Path):
    results = gloo_pool2.run(megatron_capture_task, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        assert len(res["status"]) == 3, res["status"]
        assert all(s == "applied" for s in res["status"].values()), res["status"]
        assert res["path"] == os.path.join(str(tmp_path), f"rank-{rank}.json.gz")
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json.gz", "rank-1.json.gz"]
    for rank in (0, 1):
        trace = _load(str(tmp_path / f"rank-{rank}.json.gz"))
        meta = trace["titan_parallel"]
        assert meta["rank"] == rank and meta["world_size"] == 2
        assert meta["pp"] == rank and meta["pp_size"] == 2  # PP=2 on 2 ranks: rank = stage
        assert meta == results[rank]["coords"]
        assert trace["distributedInfo"]["rank"] == rank  # PyTorch's own metadata is kept
        assert _steps(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
        # the analyzer reads the coordinates back from the file alone
        summary = summarize(str(tmp_path / f"rank-{rank}.json.gz"))
        assert summary["rank"] == rank and summary["coords"]["pp"] == rank
        # a CPU-only run has no GPU events: reported, and the file counts as partial
        assert summary["status"] == "partial"
        assert any("no GPU events" in p for p in summary["problems"])


def _fake_schedule(calls: list) -> object:
    import torch

    def forward_backward_no_pipelining(*, forward_only: bool = False) -> float:
        calls.append(forward_only)
        return float(torch.ones(8).sum())

    return forward_backward_no_pipelining


def test_wrapper_traces_exactly_the_requested_iterations(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TITAN_TRACE_STEPS", "2-3")
    monkeypatch.setenv("TITAN_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("TITAN_TRACE_GZIP", "0")
    capture.reset()
    calls: list = []
    fb = capture.wrap_schedule(_fake_schedule(calls))
    try:
        for i in range(1, 6):
            fb(forward_only=False)
            fb(forward_only=True)  # evaluation calls are not iterations
            if i <= 3:
                assert not os.listdir(tmp_path)  # written when iteration 4 begins
    finally:
        capture.reset()
    assert calls == [False, True] * 5  # the schedule itself always runs, unchanged
    assert os.listdir(tmp_path) == ["rank-0.json"]
    trace = _load(str(tmp_path / "rank-0.json"))
    assert _steps(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert "titan_parallel" in trace


def test_bad_steps_value_warns_and_leaves_training_untraced(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setenv("TITAN_TRACE_STEPS", "twelve")
    monkeypatch.setenv("TITAN_TRACE_DIR", str(tmp_path))
    monkeypatch.delenv("TITAN_PLUGINS_STRICT", raising=False)
    capture.reset()
    calls: list = []
    capture.wrap_schedule(_fake_schedule(calls))()
    assert "FIRST-LAST" in caplog.text
    assert calls == [False] and not os.listdir(tmp_path)
    capture.reset()


def test_bad_steps_value_raises_under_strict(monkeypatch):
    from titan_plugins.settings import SettingError

    monkeypatch.setenv("TITAN_TRACE_STEPS", "5-1")
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    capture.reset()
    with pytest.raises(SettingError, match="FIRST <= LAST"):
        capture.current()
    capture.reset()


@pytest.mark.parametrize(
    ("text", "expected"), [("10-12", (10, 12)), ("7", (7, 7)), (" ", None), ("3-3", (3, 3))]
)
def test_parse_steps(text: str, expected):
    assert capture.parse_steps(text) == expected


@pytest.mark.parametrize("text", ["12-10", "a-b", "-3"])
def test_parse_steps_rejects(text: str):
    with pytest.raises(ValueError, match="TITAN_TRACE_STEPS"):
        capture.parse_steps(text)


def test_plugin_declares_one_patch_per_schedule():
    from titan_trace_analysis import plugin

    patches: list = []
    plugin.titan_register_patches(patches.append)
    assert sorted(p.target for p in patches) == sorted(
        f"megatron.core.pipeline_parallel.schedules:{fn}" for fn in plugin.FUNCTIONS
    )
    assert all(p.rationale and p.remove_when for p in patches)
    assert {s.var for s in plugin.titan_settings()} == {
        "TITAN_TRACE_STEPS",
        "TITAN_TRACE_DIR",
        "TITAN_TRACE_GZIP",
    }


def test_report_states_the_capture(monkeypatch):
    from titan_trace_analysis import plugin

    capture.reset()
    monkeypatch.delenv("TITAN_TRACE_STEPS", raising=False)
    assert plugin.titan_report() == {"capture": "off (TITAN_TRACE_STEPS unset)"}
    monkeypatch.setenv("TITAN_TRACE_STEPS", "4-6")
    monkeypatch.setenv("TITAN_TRACE_DIR", "/tmp/x")
    assert plugin.titan_report() == {"capture": "iterations 4-6", "dir": "/tmp/x", "written": ""}
    capture.reset()
    monkeypatch.setenv("TITAN_TRACE_STEPS", "9-1")
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    assert plugin.titan_report()["capture"].startswith("error: TITAN_TRACE_STEPS")
    capture.reset()
