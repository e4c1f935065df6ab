"""Capture: TITAN_TRACE_STEPS makes unmodified megatron-core schedules record one Kineto trace
per rank, with the rank's parallel coordinates in the trace metadata.

The megatron test trains the tiny MoE GPT with PP=2 on the shared 2-process gloo pool through
``get_forward_backward_func()`` (the core's patched schedule firing ``titan_train_step``); the
unit tests drive the plugin's hook in-process with a stand-in schedule (no megatron) to cover
the step window logic.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from titan_trace_analysis import capture, plugin
from titan_trace_analysis.plugin import P2P_METHODS
from titan_trace_analysis.settings import SETTINGS, STEPS, parse_steps
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
    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(pp=2)
    cfg = tiny_gpt.make_config()
    chunks = tiny_gpt.build_model(cfg)
    env = {"TITAN_TRACE_STEPS": "2-3", "TITAN_TRACE_DIR": out_dir}
    capture.reset()
    with plugin_active("trace_analysis", env) as engine:
        status = {p.id: p.status for p in engine.patches() if p.id.startswith("trace_analysis.")}
        status.update(
            {p.id: p.status for p in engine.patches() if p.id.startswith("core.train_step.")}
        )
        tiny_gpt.train(chunks, cfg, steps=4, num_microbatches=2)
        path = capture.current().path
        capture.reset()
    return {"status": status, "path": path, "coords": capture.parallel_coordinates()}


@pytest.mark.multiprocess
def test_megatron_run_writes_one_trace_per_rank_with_coordinates(gloo_pool2, tmp_path: Path):
    results = gloo_pool2.run(megatron_capture_task, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        # the core's three schedule records plus one title per P2PCommunicator method
        assert len(res["status"]) == 3 + len(P2P_METHODS), res["status"]
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
        titles = {
            e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("titan.p2p:")
        }
        # stage 0 sends forward and receives backward; stage 1 the other way round
        assert titles and all(t.split(":")[1] in P2P_METHODS for t in titles)
        # the analyzer reads the coordinates back from the file alone; a CPU-only run is analysed
        summary = summarize(str(tmp_path / f"rank-{rank}.json.gz"))
        assert summary["rank"] == rank and summary["coords"]["pp"] == rank
        assert summary["status"] == "ok" and summary["device"] == "cpu", summary["problems"]


class _Step:
    """What the plugin's titan_train_step sees of one schedule call."""

    def __init__(self, forward_only: bool) -> None:
        self.forward_only = forward_only


def _call(forward_only: bool, calls: list) -> float:
    """Drive the plugin's wrapper hook around a stand-in schedule, as pluggy does."""
    import torch

    gen = plugin.titan_train_step(_Step(forward_only))
    next(gen)  # the wrapper runs up to its yield
    calls.append(forward_only)
    result = float(torch.ones(8).sum())  # the "schedule"
    try:
        gen.send(result)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the wrapper must return after the schedule")


def test_wrapper_traces_exactly_the_requested_iterations(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TITAN_TRACE_STEPS", "2-3")
    monkeypatch.setenv("TITAN_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("TITAN_TRACE_GZIP", "0")
    capture.reset()
    calls: list = []
    try:
        for i in range(1, 6):
            assert _call(False, calls) == 8.0  # the schedule's result goes through unchanged
            _call(True, calls)  # evaluation calls are not iterations
            if i <= 3:
                assert not os.listdir(tmp_path)  # written when iteration 4 begins
        assert plugin.titan_effects() == {"trace_files_written": 1, "traced_iterations": 2}
    finally:
        capture.reset()
    assert calls == [False, True] * 5  # the schedule itself always runs, unchanged
    assert os.listdir(tmp_path) == ["rank-0.json"]
    trace = _load(str(tmp_path / "rank-0.json"))
    assert _steps(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert "titan_parallel" in trace


def test_p2p_titles_only_while_recording(tmp_path: Path, monkeypatch):
    """The P2P wrapper is a pass-through until a capture records, then titles the call."""
    import torch

    def recv_forward(x: int) -> int:
        return x + 1

    wrapped = capture.wrap_p2p(recv_forward)
    assert wrapped(1) == 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        monkeypatch.setattr(capture, "_RECORDING", True)
        assert wrapped(2) == 3
    names = [e.name for e in prof.events()]
    assert "titan.p2p:recv_forward" in names


def test_bad_steps_value_warns_and_leaves_training_untraced(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setenv("TITAN_TRACE_STEPS", "twelve")
    monkeypatch.setenv("TITAN_TRACE_DIR", str(tmp_path))
    monkeypatch.delenv("TITAN_PLUGINS_STRICT", raising=False)
    capture.reset()
    calls: list = []
    _call(False, calls)
    assert "FIRST-LAST" in caplog.text and "TITAN_TRACE_STEPS" in caplog.text
    assert calls == [False] and not os.listdir(tmp_path)
    capture.reset()


def test_bad_steps_value_raises_under_strict(monkeypatch):
    from titan_plugins.settings import SettingError

    monkeypatch.setenv("TITAN_TRACE_STEPS", "5-1")
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    capture.reset()
    with pytest.raises(SettingError, match="FIRST <= LAST"):
        capture.current()
    assert STEPS.problem() is not None  # the core's activation check sees it too
    capture.reset()


@pytest.mark.parametrize(
    ("text", "expected"), [("10-12", (10, 12)), ("7", (7, 7)), (" ", None), ("3-3", (3, 3))]
)
def test_parse_steps(text: str, expected):
    assert parse_steps(text) == expected


@pytest.mark.parametrize("text", ["12-10", "a-b", "-3"])
def test_parse_steps_rejects(text: str):
    with pytest.raises(ValueError, match="FIRST"):
        parse_steps(text)


def test_plugin_declares_p2p_titles_and_typed_settings():
    patches: list = []
    plugin.titan_register_patches(patches.append)
    assert sorted(p.target for p in patches) == sorted(
        f"{plugin.P2P}.{m}" for m in plugin.P2P_METHODS
    )
    assert all(p.rationale and p.remove_when for p in patches)
    assert plugin.titan_settings() == SETTINGS
    assert [(s.name, s.type, s.default) for s in SETTINGS] == [
        ("TITAN_TRACE_STEPS", str, ""),
        ("TITAN_TRACE_DIR", str, "titan_traces"),
        ("TITAN_TRACE_GZIP", bool, True),
    ]


def test_report_states_the_capture(monkeypatch):
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
