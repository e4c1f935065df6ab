"""Bad input: truncated JSON, corrupt gzip, a missing rank, duplicate ranks, no ProfilerStep,
no distributed info.  Each is reported for its file, the other ranks are analysed, and the
exit code says the result is partial."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import gen_traces
from titan_trace_analysis import cli
from titan_trace_analysis.reader import TraceReader


def _text(path: Path) -> str:
    with gzip.open(path, "rt") as fh:
        return fh.read()


def test_each_bad_file_is_reported_and_the_rest_analysed(tmp_path: Path):
    d = tmp_path / "traces"
    gen_traces.generate(
        ["--out", str(d), "--ranks", "8", "--layers", "1", "--microbatches", "4", "--steps", "2"]
    )
    # 1: truncated plain JSON (cut while copying)
    text = _text(d / "rank-1.json.gz")
    (d / "rank-1.json.gz").unlink()
    (d / "rank-1.json").write_text(text[: len(text) * 2 // 3])
    # 2: corrupt gzip (cut in the middle of the compressed stream)
    raw = (d / "rank-2.json.gz").read_bytes()
    (d / "rank-2.json.gz").write_bytes(raw[: len(raw) // 2])
    # 3: missing rank
    (d / "rank-3.json.gz").unlink()
    # 4: duplicate rank (the same trace twice under two names)
    shutil.copy(d / "rank-4.json.gz", d / "rank-4-copy.json.gz")
    # 5: no ProfilerStep annotations
    text = _text(d / "rank-5.json.gz").replace("ProfilerStep#", "IterationMark#")
    (d / "rank-5.json.gz").write_bytes(gzip.compress(text.encode()))
    # 6: no distributed info, and a file name without a rank
    text = _text(d / "rank-6.json.gz").replace('"distributedInfo"', '"otherInfo"')
    (d / "rank-6.json.gz").unlink()
    (d / "trace-six.json").write_text(text)

    out = tmp_path / "out"
    rc = cli.main(["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "2"])
    assert rc == cli.EXIT_PARTIAL
    report = json.loads((out / "report.json").read_text())
    by_file: dict[str, list[str]] = {}
    for p in report["problems"]:
        by_file.setdefault(Path(p["file"]).name, []).append(p["problem"])
    assert "truncated JSON" in " ".join(by_file["rank-1.json"])
    assert "corrupt or truncated" in " ".join(by_file["rank-2.json.gz"])
    dup = [n for n in ("rank-4.json.gz", "rank-4-copy.json.gz") if n in by_file]
    assert len(dup) == 1 and "duplicate rank 4" in by_file[dup[0]][0]
    assert "no ProfilerStep" in " ".join(by_file["rank-5.json.gz"])
    assert "no distributedInfo.rank" in " ".join(by_file["trace-six.json"])
    missing = " ".join(by_file["(directory)"])
    assert "missing ranks 1, 2, 3, 6 of world size 8" in missing
    # the rest is analysed: ranks 0, 4, 7 with steps, rank 5 without
    assert set(report["ranks"]) == {"0", "4", "5", "7"}
    assert report["ranks"]["5"]["mean_per_step"] is None
    assert report["steps"] == ["10", "11"]
    assert report["critical_path"]["steps"]
    # rank 0 (stage 0) receives from rank 2 (stage 1), which is unreadable: said, not hidden
    assert all(2 in st["unresolved_peers"] for st in report["critical_path"]["steps"].values())
    for r in ("0", "4", "7"):
        assert report["ranks"][r]["mean_per_step"]["compute_us"] > 0


def test_clean_directory_exits_zero_and_empty_one_fails(tmp_path: Path):
    d = tmp_path / "t"
    gen_traces.generate(
        ["--out", str(d), "--ranks", "2", "--pp", "2", "--layers", "1", "--steps", "1"]
    )
    assert cli.main(["analyze", str(d), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["analyze", str(empty), "--out", str(tmp_path / "o2")]) == cli.EXIT_FAILED
    assert cli.main(["analyze", str(tmp_path / "nope")]) == cli.EXIT_USAGE


def test_reader_recovers_events_cut_inside_strings(tmp_path: Path):
    """A '}, {' inside an args string splits an event in two pieces; it is rejoined."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "k<{a}, {b}>", "ts": 1, "dur": 2, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "op", "ts": 1, "dur": 2, "args": {"l": [{"a": 1}, {"b": 2}]}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 5, "dur": 1, "args": {"stream": 7}},
        {"name": "k3<{c}, {d}>", "ph": "X", "cat": "kernel", "ts": 7, "dur": 1, "args": {}},
    ]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 3}}))
    reader = TraceReader(str(path))
    got = [e["name"] for e in reader.events()]
    assert got == ["k<{a}, {b}>", "k2", "k3<{c}, {d}>"]  # cut before and after "cat"
    assert reader.bad_events == 0
    assert reader.header["distributedInfo"]["rank"] == 3  # metadata after the events is read
