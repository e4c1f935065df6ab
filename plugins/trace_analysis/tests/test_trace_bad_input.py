"""Bad input: every damaged file is reported for itself, salvaged where it can be, and the other
ranks are analysed; the exit code says the result is partial.

Damage seen in practice (a copy cut short, a corrupt gzip, a missing rank, the same rank twice,
no ProfilerStep, no distributed info) and hostile headers (issue 14: world sizes of 10**11, ranks
that are strings, lists or paths, non-finite timestamps, deep nesting) and directory entries
(symlink loops, dangling links, FIFOs, unreadable files, escape sequences in names).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import gen_traces
import pytest
from titan_trace_analysis import cli
from titan_trace_analysis.reader import TraceReader
from titan_trace_analysis.summarize import summarize

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _text(path: Path) -> str:
    with gzip.open(path, "rt") as fh:
        return fh.read()


def _strict_json(path: Path) -> dict:
    def reject(name: str) -> None:
        raise AssertionError(f"{name} in {path}: not valid JSON")

    return json.loads(path.read_text(), parse_constant=reject)


def _by_file(report: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in report["problems"]:
        out.setdefault(Path(p["file"]).name, []).append(p["problem"])
    return out


def test_each_bad_file_is_reported_salvaged_or_skipped_and_the_rest_analysed(tmp_path: Path):
    d = tmp_path / "traces"
    gen_traces.generate(
        ["--out", str(d), "--ranks", "8", "--layers", "1", "--microbatches", "4", "--steps", "3"]
    )
    text = _text(d / "rank-1.json.gz")  # 1: plain JSON cut while copying
    (d / "rank-1.json.gz").unlink()
    (d / "rank-1.json").write_text(text[: len(text) * 3 // 4])
    raw = (d / "rank-2.json.gz").read_bytes()  # 2: gzip stream cut in the middle
    (d / "rank-2.json.gz").write_bytes(raw[: len(raw) * 3 // 4])
    (d / "rank-3.json.gz").unlink()  # 3: missing
    shutil.copy(d / "rank-4.json.gz", d / "rank-4-copy.json.gz")  # 4: the same rank twice
    text = _text(d / "rank-5.json.gz").replace("ProfilerStep#", "IterationMark#")  # 5: no steps
    (d / "rank-5.json.gz").write_bytes(gzip.compress(text.encode()))
    text = _text(d / "rank-6.json.gz").replace('"distributedInfo"', '"otherInfo"')  # 6: no rank
    (d / "rank-6.json.gz").unlink()
    (d / "trace-six.json").write_text(text)

    out = tmp_path / "out"
    rc = cli.main(["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "2"])
    assert rc == cli.EXIT_PARTIAL
    report = _strict_json(out / "report.json")
    by_file = _by_file(report)
    assert "never closes" in " ".join(by_file["rank-1.json"])
    assert "gzip stream ends early" in " ".join(by_file["rank-2.json.gz"])
    dup = [n for n in ("rank-4.json.gz", "rank-4-copy.json.gz") if n in by_file]
    assert len(dup) == 1 and "duplicate rank 4" in by_file[dup[0]][0]
    assert "no ProfilerStep" in " ".join(by_file["rank-5.json.gz"])
    assert "no valid rank" in " ".join(by_file["trace-six.json"])
    assert "missing ranks 3, 6 of world size 8" in " ".join(by_file["(directory)"])
    # the cut files are salvaged: complete steps analysed, the rank marked partial, and said so
    assert set(report["ranks"]) == {"0", "1", "2", "4", "5", "7"}
    for r in ("1", "2"):
        assert report["ranks"][r]["partial"] and report["ranks"][r]["mean_per_step"]
    assert any(w.startswith("partial ranks 1, 2") for w in report["warnings"])
    assert report["steps"] == ["10", "11", "12"]
    assert report["ranks"]["5"]["mean_per_step"] is None
    # the generator's slow rank (5) is found from its kernels even without steps
    assert [u["id"] for u in report["slow_units"] if u["verdict"] == "slow"] == [5]
    # steps the partial ranks lack: the critical path says it needs them
    cp = report["critical_path"]["steps"]
    assert any({1, 2} & set(st["unresolved_peers"]) for st in cp.values())
    html = (out / "report.html").read_text()
    assert html.index("Warning:") < html.index("Pipeline bubble by stage")


def test_hostile_headers_are_problems_of_their_file(tmp_path: Path, capsys):
    d = tmp_path / "t"
    gen_traces.generate(
        ["--out", str(d), "--ranks", "4", "--pp", "2", "--layers", "1", "--steps", "2",
         "--no-gzip"]
    )  # fmt: skip
    good = json.loads((d / "rank-0.json").read_text())

    def variant(name: str, **info) -> None:
        t = json.loads(json.dumps(good))
        t["distributedInfo"].update(info)
        (d / name).write_text(json.dumps(t))

    variant("huge-world.json", rank=5, world_size=10**11)
    variant("rank-three.json", rank="three")
    variant("rank-list.json", rank=[3])
    variant("rank-path.json", rank="../../etc/passwd")
    variant("rank-beyond.json", rank=7, world_size=4)
    variant("world-bool.json", rank=1, world_size=True)
    t = json.loads(json.dumps(good))  # another job's trace: a different pipeline size
    t["distributedInfo"].update(rank=2)
    for pg in t["distributedInfo"]["pg_config"]:
        if pg["pg_desc"] == "pp_group":
            pg["ranks"] = [0, 1, 2, 3]
    (d / "other-job.json").write_text(json.dumps(t))
    t = json.loads(json.dumps(good))  # 5000 nested lists in the header
    t["distributedInfo"]["rank"] = 1
    text = json.dumps(t).replace('"record_shapes"', '"deep": ' + "[" * 5000 + "]" * 5000 + ', "x"')
    (d / "deep.json").write_text(text)
    t = json.loads(json.dumps(good))  # args as a list, absurd and NaN timestamps
    t["distributedInfo"]["rank"] = 3
    kernels = [e for e in t["traceEvents"] if e.get("cat") == "kernel"]
    kernels[0]["args"] = [1, 2, 3]
    for e in kernels[1:4]:
        e["ts"] = 1e308
    for e in kernels[4:6]:
        e["dur"] = "__NAN__"
    (d / "weird-3.json").write_text(json.dumps(t).replace('"__NAN__"', "NaN"))
    for r in (1, 2, 3):
        (d / f"rank-{r}.json").unlink()
    (d / "esc\x1b[31mred.json").write_text("{}")
    out = tmp_path / "o"
    rc = cli.main(["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "1"])
    assert rc == cli.EXIT_PARTIAL
    report = _strict_json(out / "report.json")
    by_file = _by_file(report)
    assert "invalid world_size 100000000000" in " ".join(by_file["huge-world.json"])
    assert "invalid rank 'three'" in " ".join(by_file["rank-three.json"])
    assert "invalid rank [3]" in " ".join(by_file["rank-list.json"])
    assert "invalid rank '../../etc/passwd'" in " ".join(by_file["rank-path.json"])
    assert "invalid rank 7" in " ".join(by_file["rank-beyond.json"])
    assert "invalid world_size True" in " ".join(by_file["world-bool.json"])
    # 5000 nested lists: RecursionError (stdlib) / a depth error (orjson): this file only
    assert "unreadable trace" in " ".join(by_file["deep.json"])
    assert "5 events dropped" in " ".join(by_file["weird-3.json"])  # 3 ts 1e308, 2 NaN
    # world-bool.json's rank (1) is valid, its size is not; weird-3.json is analysed
    assert set(report["ranks"]) == {"0", "1", "2", "3"}
    assert "files disagree on pp_size" in " ".join(by_file["(directory)"])
    assert report["world_size"] == 4  # the huge / bogus sizes did not win
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "esc\\x1b[31mred.json" in printed
    assert not list((out).glob("**/*passwd*"))


def test_directory_entries_that_cannot_be_read_are_reported(tmp_path: Path):
    d = tmp_path / "t"
    gen_traces.generate(["--out", str(d), "--ranks", "2", "--pp", "2", "--layers", "1",
                         "--steps", "1"])  # fmt: skip
    (d / "loop.json").symlink_to(d / "loop.json")
    (d / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    os.mkfifo(d / "pipe.json")
    (d / "eio.json").symlink_to("/proc/self/mem")  # regular per stat, but every read fails
    out = tmp_path / "o"
    rc = cli.main(["analyze", str(d), "--out", str(out), "--no-progress", "--workers", "1"])
    assert rc == cli.EXIT_PARTIAL
    by_file = _by_file(_strict_json(out / "report.json"))
    assert "symlink loop" in by_file["loop.json"][0]
    assert "dangling symlink" in by_file["dangling.json"][0]
    assert "FIFO" in by_file["pipe.json"][0]
    assert "unreadable trace" in by_file["eio.json"][0] or "empty" in by_file["eio.json"][0]


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


@pytest.mark.parametrize("pure", [False, True])
def test_reader_recovers_events_cut_inside_strings(tmp_path: Path, pure: bool):
    """A '}, {' inside an args string splits an event in two pieces; it is rejoined."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "k<{a}, {b}>", "ts": 1, "dur": 2, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "op", "ts": 1, "dur": 2, "args": {"l": [{"a": 1}, {"b": 2}]}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 5, "dur": 1, "args": {"stream": 7}},
        {"name": "k3<{c}, {d}>", "ph": "X", "cat": "kernel", "ts": 7, "dur": 1, "args": {}},
    ]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 3}}))
    reader = TraceReader(str(path), pure=pure)
    got = [e["name"] for e in reader.events()]
    assert got == ["k<{a}, {b}>", "k2", "k3<{c}, {d}>"]  # cut before and after "cat"
    assert reader.bad_events == 0
    assert reader.header["distributedInfo"]["rank"] == 3  # metadata after the events is read


def test_summary_of_a_nan_trace_is_valid_json(tmp_path: Path):
    path = tmp_path / "rank-0.json"
    path.write_text(
        '{"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ['
        '{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1e308, "dur": 1e308, '
        '"args": {}},'
        '{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 5, '
        '"args": {}}]}'
    )
    s = summarize(str(path))
    json.dumps(s, allow_nan=False)
    assert s["temporal"]["span_us"] == 5.0
    assert any("1 with a ts that is not finite" in p for p in s["problems"])
