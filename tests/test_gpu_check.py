"""The one-command GPU check runs in CI in its CPU dry-run mode, so its sections cannot rot
between the rare runs on a GPU machine: every section must finish and print its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--dry-run",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    sections = {s["plugin"]: s for s in data["sections"]}
    assert data["dry_run"] is True
    assert set(sections) == {"fp8_blockwise", "act_offload", "moe_ep_overlap", "pp_rdma",
                             "trace_analysis", "rewind"}  # fmt: skip
    for name, section in sections.items():
        assert section["status"] == "ok" and section["result"], (name, section["tail"])
    assert sections["fp8_blockwise"]["result"]["quantizer_bit_identical"] is True
