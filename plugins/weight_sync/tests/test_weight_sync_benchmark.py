"""``benchmarks/weight_sync.py`` as the README runs it, at a size CI affords: for one and for two
engines it prints titan's ratios to both baselines, writes every field item 5 of the issue names
to ``--json``, and the synced engine's logprobs equal a disk-loaded engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from titan_weight_sync.cpu_engine import sglang_python

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def sglang_release() -> str:
    """The SGLang release of the SGLang venv the engines start from."""
    python = sglang_python()
    if python is None:
        return ""
    found = subprocess.run(
        [python, "-c", "from importlib.metadata import version; print(version('sglang'))"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return found.stdout.strip()


pytestmark = [
    pytest.mark.sglang,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        sglang_python() is None,
        reason="needs the SGLang venv (./scripts/sglang_env.sh); scripts/test.sh's SGLang leg "
        "runs these",
    ),
    # CI time: the figures are the default release's, and its leg runs this
    pytest.mark.skipif(
        sglang_release() not in ("", "0.5.23"),
        reason="run in the SGLang 0.5.23 leg of scripts/test.sh (the README's figures are that "
        "release's); the benchmark itself also runs against 0.5.15.post1 engines",
    ),
]


def test_the_benchmark_prints_its_ratios_and_writes_its_json(tmp_path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "weight_sync.py", "--mb", "64", "--engines", "1,2", "--rounds", "1",
         "--json", str(out)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=900,
        env={k: v for k, v in os.environ.items() if k != "TITAN_PLUGINS_AUTOLOAD"},  # a user's
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["engines"] for row in rows] == [1, 2]
    for row in rows:
        assert 50 < row["mb"] < 80  # the smallest model: one layer, the embeddings and head
        assert row["logprobs_identical"] is True
        for key in ("titan_s", "broadcast_s", "raw_write_s"):
            assert row[key] > 0, (key, row)
        line = (
            f"{row['mb']:8.1f} MB -> {row['engines']} engine(s): titan {row['titan_s']:.3f} s, "
            f"broadcast {row['broadcast_s']:.3f} s, raw write {row['raw_write_s']:.3f} s; "
            f"titan/broadcast {row['titan_s'] / row['broadcast_s']:.2f}x, "
            f"titan/raw {row['titan_s'] / row['raw_write_s']:.2f}x; logprobs identical: True"
        )
        assert line in done.stdout, done.stdout
