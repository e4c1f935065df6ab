"""Every Megatron line the plugins serve, judged on the line installed in this venv (the suite runs
on 0.16.1 and 0.19.2; docs/hosts.md runs it on 0.17.1 and 0.18.2): under STRICT no patch is
skipped by a version gate or failed, every skip is explained, a variant for another line says
so, and the core's hooks fire where that line's Megatron really calls them (the config that
0.18+'s argument_utils builds, 0.19's multi-module backward, 0.17+'s graphed optimizer step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from titan_plugins.hosts import megatron as megatron_room
from titan_plugins.patching import APPLIED, OTHER_LINE, SKIPPED, gates

PROBE = Path(__file__).with_name("lines_probe.py")


def _line(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    env = dict(os.environ, TITAN_PLUGINS_STRICT="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE ") :])


def test_no_patch_is_refused_by_a_version_gate_or_fails(probe: dict[str, Any]) -> None:
    assert gates.check(megatron_room.SUPPORTED_MEGATRON) is None  # this venv holds a supported line
    for patch in probe["patches"]:
        assert patch["status"] in (APPLIED, SKIPPED, OTHER_LINE), patch
        if patch["status"] == SKIPPED:  # only optional targets absent from this install
            assert patch["optional"] and "import" in patch["detail"], patch
            assert "version gate" not in patch["detail"], patch
        if patch["status"] == OTHER_LINE:
            # 0.18+ package_info may append the git sha of the working directory (+abc123)
            said = patch["detail"].rsplit("this is ", 1)[-1].split("+")[0]
            assert said == probe["version"].split("+")[0], patch
    applied = [p["id"] for p in probe["patches"] if p["status"] == APPLIED]
    assert "core.train_step.1f1b" in applied or any(
        i.startswith("core.train_step") for i in applied
    )


def test_the_config_hook_sees_the_model_config_where_this_line_builds_it(
    probe: dict[str, Any],
) -> None:
    if probe["configure"].startswith("no megatron.training"):
        # 0.16.1's wheel has no megatron.training (a Megatron-LM checkout does:
        # test_megatron_lm_e2e.py); the record is then an optional, explained skip.
        assert _line(probe["version"]) < (0, 17)
        assert probe["seen"]["configure"] == []
        return
    assert probe["seen"]["configure"] == ["TransformerConfig"], probe["configure"]
    if _line(probe["version"]) >= (0, 19):
        assert probe["configure"] == "argument_utils.gpt_config_from_args"


def test_the_multimodule_backward_fires_the_backward_hook_from_0_17(
    probe: dict[str, Any],
) -> None:
    # backward_step_multimodule arrived in 0.17.0 (schedules.py:514, chosen at :2156 in 0.17.1).
    if _line(probe["version"]) < (0, 17):
        assert probe["multimodule"] == "absent"
        return
    assert probe["multimodule"] == "grad [2.0, 2.0, 2.0]"  # Megatron's own backward ran
    assert probe["seen"]["backward"] == ["tensor"]


def test_a_graphed_optimizer_step_fires_the_optimizer_hook_on_every_replay(
    probe: dict[str, Any],
) -> None:
    if _line(probe["version"]) < (0, 17):
        assert probe["graphed"] == "absent"
        return
    # One eager step before the capture, then three replays: the optimizer's own step ran
    # once, the hook fired for all four training-loop calls, each with the real optimizer.
    assert probe["graphed"] == "steps 1, replays 3"
    assert probe["seen"]["optimizer"] == ["Optimizer"] * 4
