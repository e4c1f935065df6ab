"""The map step gives the same summaries on the local pool and on Ray; without Ray the error
names the fix."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gen_traces
import pytest
from titan_trace_analysis.discover import find_traces
from titan_trace_analysis.engine import EngineError, run_map

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _small_set(root: Path) -> list[str]:
    gen_traces.generate(
        ["--out", str(root), "--ranks", "4", "--pp", "2", "--layers", "1", "--steps", "1"]
    )
    paths, problems = find_traces(str(root))
    assert not problems
    return paths


def _comparable(summaries: list[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "timeline"} for s in summaries]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_engine_matches_local_pool(tmp_path: Path):
    import ray

    paths = _small_set(tmp_path / "t")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    local = run_map(paths, str(tmp_path / "a"), engine="local", workers=2, progress=False)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        remote = run_map(paths, str(tmp_path / "b"), engine="ray", progress=False)
    finally:
        ray.shutdown()
    assert [s.get("rank") for s in remote] == [0, 1, 2, 3]
    assert _comparable(remote) == _comparable(local)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        f"tl-{i}.tl"
        for i in range(4)  # named by input position, never by the trace's rank
    ]


def test_ray_missing_names_the_fix(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(EngineError, match="pip install 'ray"):
        run_map(["x.json"], str(tmp_path), engine="ray", progress=False)


def test_local_pool_keeps_input_order_and_reports_progress(tmp_path: Path, capsys):
    paths = _small_set(tmp_path / "t")
    out = run_map(list(reversed(paths)), None, engine="local", workers=2, progress=True)
    assert [s["file"] for s in out] == list(reversed(paths))
    assert "4/4" in capsys.readouterr().err


START_METHOD = """
import threading, time
from titan_trace_analysis.engine import start_method
alone, many = start_method(128, 2), start_method(129, 2)  # 64 files per worker at most
t = threading.Thread(target=time.sleep, args=(1,))
t.start()
print(alone, many, start_method())
"""


def test_pool_workers_fork_only_from_a_single_threaded_process():
    """The command (one thread) forks its workers; a process running other threads (a training
    job calling the analysis), or a run long enough that the pool replaces workers from its own
    threads, starts them from a fork server."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", START_METHOD], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.split() == ["fork", "forkserver", "forkserver"]


POOLED = """
import json, sys
from titan_trace_analysis import engine
engine.start_method = lambda *_: sys.argv[1]
out = engine.run_map(sys.argv[2:], None, engine="local", workers=2, progress=False)
print(json.dumps([{k: v for k, v in s.items() if k != "timeline"} for s in out]))
"""


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_both_start_methods_give_the_same_summaries(tmp_path: Path, method: str):
    """The pool runs in a fresh process, as the command does (forking pytest itself, which runs
    other tests' threads, is what the command avoids)."""
    import json
    import subprocess

    from titan_trace_analysis.summarize import summarize

    paths = _small_set(tmp_path / "t")
    done = subprocess.run([sys.executable, "-c", POOLED, method, *paths], capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    pooled = json.loads(done.stdout)
    here = json.loads(json.dumps([summarize(p, None, i) for i, p in enumerate(paths)]))
    assert pooled == _comparable(here)
