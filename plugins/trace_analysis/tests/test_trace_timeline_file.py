"""Per-step timeline files: what is written reads back step by step, and a reader parses only
the steps it asks for."""

from __future__ import annotations

from pathlib import Path

import pytest
from titan_trace_analysis import lateness, timeline_file

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _steps() -> dict:
    return {
        "7": {
            "win": [1.0, 9.5],
            "comp": [1.0, 2.0, 3.0, 4.5],
            "ops": [["pp_recv", 2.0, 3.0, "", 1, 0]],
            "bub": [2.0, 3.0],
        },  # fmt: skip
        "8": {"win": [10.0, 20.0], "comp": [], "ops": [], "bub": []},
        "10": {"win": [30.0, 31.0], "comp": [30.0, 31.0], "ops": [], "bub": []},
    }


def test_steps_read_back_as_written(tmp_path: Path):
    path = str(tmp_path / f"tl-0{timeline_file.SUFFIX}")
    keys = {"all_gather:dp:0,1": [0, 1], "odd\nkey \u00e9": None}  # a newline inside a string
    timeline_file.write(path, 3, keys, _steps())
    assert timeline_file.read_steps(path) == {"rank": 3, "keys": keys, "steps": _steps()}
    assert timeline_file.read_steps(path, ["10", "9", "7"]) == {
        "rank": 3,
        "keys": keys,
        "steps": {"10": _steps()["10"], "7": _steps()["7"]},  # 9 was not recorded
    }
    assert timeline_file.read_step(path, "8") == _steps()["8"]
    assert timeline_file.read_step(path, "9") is None


def test_a_step_is_read_without_parsing_the_others(tmp_path: Path):
    path = tmp_path / "tl-1.tl"
    timeline_file.write(str(path), 0, {}, _steps())
    data = path.read_bytes()
    head, body = data.split(b"\n", 1)
    damaged = body.replace(b'"win":[10.0,20.0]', b'"win":[10.0,20.0}', 1)
    assert damaged != body  # step 8's blob no longer parses
    path.write_bytes(head + b"\n" + damaged)
    assert timeline_file.read_step(str(path), "7") == _steps()["7"]
    assert timeline_file.read_step(str(path), "10") == _steps()["10"]


def test_no_steps(tmp_path: Path):
    path = str(tmp_path / "tl-2.tl")
    timeline_file.write(path, 0, {}, {})
    assert timeline_file.read_steps(path) == {"rank": 0, "keys": {}, "steps": {}}


@pytest.mark.parametrize(
    "text",
    [
        b'{"rank": 0, "keys": {}, "steps": {"1": {"ops": []}}}',  # the previous whole-file layout
        b"[1, 2]\n",
        b'{"format": 1, "rank": 0, "keys": {}}\n',
        b'{"format": 1, "keys": {}, "index": {}}\n',  # no rank
        b'{"format": 1, "rank": 0, "keys": {}, "index": {"1": [0]}}\n{}',
        b'{"format": 1, "rank": 0, "keys": {}, "index": {"1": ["0", 2]}}\n{}',
        b'{"format": 1, "rank": 0, "keys": {}, "index": {"1": [0, -1]}}\n{}',
        b'{"format": 1, "rank": 0, "keys": {}, "index": ["1"]}\n{}',
        b'{"format": 1, "rank": 0, "keys": {}, "index": {"1": [0, 1]}}\n7',  # a step, not a dict
        b'{"format": 2, "rank": 0, "keys": {}, "index": {}}\n',
    ],
)
def test_a_file_of_another_layout_or_damaged_is_refused_with_value_error(tmp_path: Path, text):
    """Readers of a damaged timeline catch ValueError (lateness skips that rank): a file in
    another layout or with a bad header never becomes a KeyError / TypeError mid-analysis."""
    path = tmp_path / "tl-3.tl"
    path.write_bytes(text)
    with pytest.raises(ValueError):
        timeline_file.read_steps(str(path), ["1"])
    assert lateness._load(str(path), ["1"]) is None
