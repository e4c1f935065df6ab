"""Bounded input and a command line that fails in one line (issue 29).

A decompressed monster (a 2 GiB string inside a 2 MB gzip) is refused after reading about the
per-event limit, not after inflating all of it: the tests count the bytes read, not seconds.
A string over the per-string limit costs its event, counted.  ``--out`` that is a file, lies
under a file or cannot be created, and a DIR that is missing, a file or holds no traces, are
one line and an exit code, never a traceback.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import gen_traces
import pytest
from titan_trace_analysis import cli
from titan_trace_analysis.reader import TraceError, TraceReader
from titan_trace_analysis.source import INFLATE_CHUNK
from titan_trace_analysis.summarize import Options, summarize

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

MIB = 1 << 20
EVENT_LIMIT = 16 * MIB  # the documented default


def _bomb(path: Path, string_mib: int) -> Path:
    """A trace whose one kernel name is ``string_mib`` MiB of "a": gzip members of 1 MiB each,
    concatenated (as gzip allows), so 2 GiB of text take 2 MB on disk and no time to make."""
    head = b'{"traceEvents": [{"ph": "X", "cat": "kernel", "pid": 0, "tid": 7, "ts": 1, "name": "'
    block = gzip.compress(b"a" * MIB, compresslevel=9)
    path.write_bytes(gzip.compress(head) + block * string_mib + gzip.compress(b'", "dur": 1}]}'))
    return path


@pytest.mark.parametrize("pure", [False, True])
def test_a_2_gib_string_in_a_2_mb_gzip_is_refused_after_the_limit(tmp_path: Path, pure: bool):
    path = _bomb(tmp_path / "rank-0.json.gz", 2048)
    assert path.stat().st_size < 4 * MIB
    reader = TraceReader(str(path), pure=pure)
    with pytest.raises(TraceError) as err:
        for _batch in reader.records():
            pass
    # inflation stopped one chunk past the limit: 2 GiB were never decompressed
    assert EVENT_LIMIT < reader.bytes_read <= EVENT_LIMIT + 2 * INFLATE_CHUNK
    msg = str(err.value)
    assert "16 MiB" in msg and "--max-event-mb" in msg, msg
    s = summarize(str(path), options=Options(pure=pure))
    assert s["status"] == "error" and s["problems"] == [msg]


def test_a_2_gib_string_in_the_header_is_refused_after_64_mib(tmp_path: Path):
    head = gzip.compress(b'{"x": "')
    block = gzip.compress(b"a" * MIB, compresslevel=9)
    path = tmp_path / "rank-0.json.gz"
    path.write_bytes(head + block * 2048 + gzip.compress(b'", "traceEvents": []}'))
    reader = TraceReader(str(path))
    with pytest.raises(TraceError, match='no "traceEvents" array in the first 64 MiB'):
        for _batch in reader.records():
            pass
    assert 64 * MIB < reader.bytes_read <= 64 * MIB + 2 * INFLATE_CHUNK


def test_the_event_limit_is_raised_with_its_flag(tmp_path: Path, capsys):
    d = tmp_path / "t"
    d.mkdir()
    _bomb(d / "rank-0.json.gz", 24)
    out = str(tmp_path / "o")
    assert cli.main(["analyze", str(d), "--out", out, "--no-progress"]) == cli.EXIT_FAILED
    assert "an event of more than 16 MiB" in capsys.readouterr().out
    # allowed, the 24 MiB kernel name is then a string over the per-string limit (4 MiB)
    s = summarize(str(d / "rank-0.json.gz"), options=Options(max_event_bytes=32 * MIB))
    assert s["dropped"]["reasons"] == {"string": 1}, s["problems"]
    assert "--max-string-mb" in " ".join(s["problems"])
    opts = Options(max_event_bytes=32 * MIB, max_string_bytes=32 * MIB)
    for pure in (False, True):
        s = summarize(str(d / "rank-0.json.gz"), options=replace(opts, pure=pure))
        assert "dropped" not in s and s["names"] == {"a" * 24 * MIB: [1.0, 1.0]}


@pytest.mark.parametrize("native", [False, True])
def test_a_string_over_the_limit_costs_its_event_on_both_loops(tmp_path: Path, native: bool):
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 3, "dur": 1,
         "args": {"note": "x" * (MIB + 1)}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 5, "dur": 1},
    ]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    reader = TraceReader(str(path), native=native, max_string=MIB)
    items = [ev for batch in reader.records() for ev in batch]
    assert len(items) == 2 and dict(reader.drops.reasons) == {"string": 1}
    assert dict(reader.drops.kinds) == {"compute kernel": 1}


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    text = (captured.err + captured.out).strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    return text


def _traces(tmp_path: Path) -> Path:
    d = tmp_path / "t"
    gen_traces.generate(["--out", str(d), "--ranks", "2", "--pp", "2", "--layers", "1",
                         "--steps", "1"])  # fmt: skip
    return d


def test_an_out_path_that_cannot_be_a_folder_is_one_line_and_exit_2(tmp_path: Path, capsys):
    d = _traces(tmp_path)
    a_file = tmp_path / "report.txt"
    a_file.write_text("keep me")
    cases = {
        str(a_file): "is a file",
        str(a_file / "sub"): "not a directory",
        "/proc/titan-trace-report": "cannot create",  # root cannot write there either
        str(d): "the trace directory",  # report.json would be read as a trace next time
    }
    for out, problem in cases.items():
        assert cli.main(["analyze", str(d), "--out", out, "--no-progress"]) == cli.EXIT_USAGE
        line = _one_line(capsys)
        assert line.startswith("titan-trace: --out ") and out in line and problem in line, line
    assert a_file.read_text() == "keep me" and not (d / "report.json").exists()


def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(tmp_path: Path, capsys):
    d = _traces(tmp_path)
    out = tmp_path / "o"
    (out / "report.html").mkdir(parents=True)  # in the way of the file
    assert cli.main(["analyze", str(d), "--out", str(out), "--no-progress"]) == cli.EXIT_USAGE
    line = _one_line(capsys)
    assert "cannot write" in line and "report.html" in line, line


def test_a_bad_trace_dir_is_one_line(tmp_path: Path, capsys):
    a_file = tmp_path / "x.json"
    a_file.write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "o")
    cases = [
        (tmp_path / "nope", cli.EXIT_USAGE, "does not exist"),
        (a_file, cli.EXIT_USAGE, "is a file, not a directory"),
        (empty, cli.EXIT_FAILED, "no *.json / *.json.gz traces"),
    ]
    for trace_dir, code, problem in cases:
        assert cli.main(["analyze", str(trace_dir), "--out", out, "--no-progress"]) == code
        line = _one_line(capsys)
        assert str(trace_dir) in line and problem in line, line


@pytest.mark.parametrize(
    "flag,value",
    [("--workers", "-1"), ("--merged-ranks", "-5"), ("--max-ranks", "-1"),
     ("--ranks-per-node", "-2"), ("--max-event-mb", "0"), ("--max-string-mb", "nan"),
     ("--max-event-mb", "-3")],
)  # fmt: skip
def test_out_of_range_numbers_name_their_flag(tmp_path: Path, capsys, flag: str, value: str):
    d = tmp_path / "t"
    d.mkdir()
    args = ["analyze", str(d), "--out", str(tmp_path / "o"), flag, value]
    assert cli.main(args) == cli.EXIT_USAGE
    line = _one_line(capsys)
    assert line.startswith(f"titan-trace: {flag} "), line
