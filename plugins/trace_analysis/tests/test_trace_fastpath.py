"""The fast path (orjson + ISA-L, normal dependencies) and the pure-Python fallback give the same
analysis: in-process with ``--pure-python``, and in a process where orjson and isal cannot be
imported at all (the install on a platform without their wheels)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gen_traces
import pytest
from titan_trace_analysis import fastpath
from titan_trace_analysis.summarize import Options, summarize

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

TOOLS = str(Path(__file__).resolve().parents[1] / "tools")
NO_FAST = """
import json, sys
sys.modules["orjson"] = None  # import orjson -> ImportError, as where no wheel exists
sys.modules["isal"] = None
from titan_trace_analysis import fastpath
from titan_trace_analysis.summarize import summarize
assert fastpath.codec().name == "stdlib", fastpath.codec().name
print(json.dumps(summarize(sys.argv[1])))
"""


def _comparable(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in ("timeline",)}


def test_default_install_uses_the_fast_path():
    assert fastpath.codec().name == "orjson+isal"
    assert fastpath.codec(pure=True).name == "stdlib"


def test_pure_python_and_fast_path_agree(tmp_path: Path):
    gen_traces.generate(["--out", str(tmp_path / "t"), "--ranks", "4", "--pp", "2",
                         "--layers", "1", "--steps", "2", "--no-collective-args"])  # fmt: skip
    for r in range(4):
        path = str(tmp_path / "t" / f"rank-{r}.json.gz")
        fast = summarize(path, options=Options())
        pure = summarize(path, options=Options(pure=True))
        assert fast["status"] == "ok" and _comparable(fast) == _comparable(pure)
        out = subprocess.run(
            [sys.executable, "-c", NO_FAST, path], capture_output=True, text=True, check=True
        ).stdout
        assert _comparable(json.loads(out)) == json.loads(json.dumps(_comparable(fast)))


def test_truncated_gzip_salvage_is_the_same_on_both_paths(tmp_path: Path):
    gen_traces.generate(["--out", str(tmp_path / "t"), "--ranks", "2", "--pp", "2",
                         "--layers", "1", "--steps", "3"])  # fmt: skip
    raw = (tmp_path / "t" / "rank-1.json.gz").read_bytes()
    cut = tmp_path / "rank-1.json.gz"
    cut.write_bytes(raw[: len(raw) * 2 // 3])
    fast = summarize(str(cut))
    pure = summarize(str(cut), options=Options(pure=True))
    assert fast["truncated"] and fast["steps"] and _comparable(fast) == _comparable(pure)
