"""Installed for real in a fresh venv with the core and nothing else: the plugin loads through
the automatic channel and rolls a NaN back in a real (tiny) training run."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from titan_plugins.testing.freshenv import clean_env, make_venv, pip_install

ROOT = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).parent / "installed" / "probe.py"
pytestmark = pytest.mark.installed


def test_installs_alone_with_the_core_and_rewinds(tmp_path):
    python = make_venv(tmp_path / "venv")
    pip_install(python, ROOT, ROOT / "plugins" / "rewind")
    env = clean_env(
        {
            "TITAN_REWIND_INTERVAL": "2",
            "TITAN_REWIND_STABLE_AFTER": "1",
            "TITAN_REWIND_INJECT_NAN_STEP": "6",
        }
    )
    done = subprocess.run(
        [str(python), str(PROBE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [json.loads(x[6:]) for x in done.stdout.splitlines() if x.startswith("PROBE ")]
    assert line["plugins"] == {"rewind": "enabled"}  # no other plugin came along
    (event,) = line["effect"]["events"]
    # Snapshots after steps 0, 2, 4 (stable one step later): step 6's NaN restores step 4's.
    assert (event["step"], event["trigger"], event["snapshot_step"]) == (6, "nonfinite_loss", 4)
    assert math.isnan(line["losses"][6]) and all(math.isfinite(x) for x in line["losses"][7:])
    assert "rewind: step 6: nonfinite_loss" in done.stderr
