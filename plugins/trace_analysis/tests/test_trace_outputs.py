"""The outputs engineers open: the merged multi-rank Chrome trace (Perfetto) with the critical path
as flow events and the bubbles as slices, and the HTML report rendered by a real browser
(headless Chromium: a screenshot is taken and the page logs no console error)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import gen_traces
import pytest
from titan_trace_analysis import cli
from titan_trace_analysis.merged_trace import TID_BUBBLE, TID_PATH

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _chromium() -> str | None:
    """A headless Chromium that starts here (the probe), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        exe = shutil.which(name)
        if exe is None:
            continue
        try:
            probe = subprocess.run([exe, "--version"], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return exe
    return None


CHROMIUM = _chromium()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[dict, dict, Path]:
    """(generator info, report, output folder) of an 8-rank job analysed by the CLI."""
    root = tmp_path_factory.mktemp("out")
    info = gen_traces.generate(
        ["--out", str(root / "t"), "--ranks", "8", "--layers", "1", "--microbatches", "4",
         "--steps", "2", "--slow-ranks", "5"]
    )  # fmt: skip
    args = ["analyze", str(root / "t"), "--out", str(root / "o"), "--no-progress", "--workers", "2"]
    assert cli.main(args) == cli.EXIT_OK
    return info, json.loads((root / "o" / "report.json").read_text()), root / "o"


def test_merged_trace_is_a_chrome_trace_with_the_path_as_flows(job):
    info, report, out = job
    trace = json.loads((out / "merged_trace.json").read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(e["dur"] >= 0 and {"pid", "tid", "ts", "name"} <= set(e) for e in slices)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}, stage {r // 2}" for r in range(8)}  # rank = dp + 2 * stage
    # slices on one thread never partly overlap (Perfetto needs them nested)
    by_thread: dict[tuple, list] = {}
    for e in slices:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))
    # the critical path: one slice per segment, consecutive segments linked by a flow
    path = [e for e in slices if e["tid"] == TID_PATH]
    segs = report["critical_path"]["segments"]
    assert len(path) == len(segs)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert set(starts) == set(ends) == set(range(len(segs) - 1))
    for i, (a, b) in enumerate(zip(segs, segs[1:])):
        assert (starts[i]["pid"], ends[i]["pid"]) == (a[0], b[0])
    # the bubble slices of the step are the simulator's pipeline stalls
    k = report["steps"].index(report["critical_path"]["detail_step"])
    for r in range(8):
        ours = sum(e["dur"] for e in slices if e["pid"] == r and e["tid"] == TID_BUBBLE)
        truth = info["truth"]["by_rank"][str(r)][k]["stall_us"]
        assert ours == pytest.approx(truth, rel=0.01, abs=5.0)


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (apt-get install chromium)")
def test_html_report_renders_in_chromium_without_console_errors(job, tmp_path: Path):
    _, _, out = job
    shot = tmp_path / "report.png"
    run = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", "--window-size=1300,2400",
         f"--screenshot={shot}", (out / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []


def test_html_report_keeps_missing_ranks_in_place_and_labels_cells(tmp_path: Path):
    d = tmp_path / "t"
    gen_traces.generate(["--out", str(d), "--ranks", "8", "--layers", "1", "--steps", "1"])
    (d / "rank-3.json.gz").unlink()
    out = tmp_path / "o"
    assert cli.main(["analyze", str(d), "--out", str(out), "--no-progress"]) == cli.EXIT_PARTIAL
    html = (out / "report.html").read_text()
    assert "rank 3: missing" in html  # a hatched cell where rank 3 sits, not a shifted row
    assert html.count("url(#hatch)") == 2  # in both heatmaps
    for r in range(8):
        assert f"rank {r}:" in html
    assert "bubble share of the step" in html and "100%" in html  # the colour scale
