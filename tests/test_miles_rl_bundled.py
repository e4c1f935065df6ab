"""miles-rl's bundled Megatron: plugins load, each patch applied, skipped with a reason, or left
as written for another supported line.

``miles-rl`` 0.0.2 (PyPI) ships its own modified ``megatron/`` (core 0.16.0rc0 plus training)
inside its own distribution; there is no megatron-core distribution. This test builds a fresh
venv with the Titan distributions, ``pip install --no-deps miles-rl==0.0.2`` and what its
``megatron.training`` imports (six, regex, pydantic; triton is stubbed while the one module that
imports it executes, as in :mod:`titan_plugins.testing.megatron_lm`), imports every patch
target and reads the report. Skipped, with the pip probe's output, where the package index
cannot be reached.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.patching import APPLIED, OTHER_LINE, SKIPPED
from titan_plugins.testing.freshenv import clean_env, make_venv, pip_install

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(
    p for p in (ROOT / "plugins").iterdir() if (p / "setup.cfg").exists() and p.name[0] != "_"
)
MILES = "miles-rl==0.0.2"
TRAINING_DEPS = ("six", "regex", "pydantic")
PROBE = """
import json
from titan_plugins.testing import megatron_lm
megatron_lm.install()  # CPU harness and the triton stub for megatron.training
import contextlib, io
from titan_plugins.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["report", "--import-targets"])
print("REPORT " + json.dumps(json.loads(out.getvalue())))
"""

# what the engine says of a record gated on later lines only (megatron_lines("0.17") and up)
LATER_LINES = re.compile(r"written for megatron-core >=0\.1[789],<0\.\d+; this is 0\.16\.0rc0")
pytestmark = pytest.mark.installed


def _pip(python: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    target = ["--python", str(python)] if python else []
    return subprocess.run(
        [sys.executable, "-m", "pip", *target, *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("miles")
    probe = _pip(None, "download", "--no-deps", MILES, "-d", str(tmp / "wheels"))
    assert probe.returncode == 0, f"pip cannot download {MILES}: {probe.stderr.strip()[-400:]}"
    python = make_venv(tmp / "venv", exclude=("megatron",))
    pip_install(python, ROOT, *PLUGINS)
    wheel = next((tmp / "wheels").glob("miles_rl-*.whl"))
    for args in (("--no-deps", str(wheel)), TRAINING_DEPS):
        done = _pip(python, "install", "-q", *args)
        assert done.returncode == 0, f"pip cannot install {args}: {done.stderr.strip()[-400:]}"
    done = subprocess.run(
        [str(python), "-c", PROBE],
        env=clean_env({"TORCH_COMPILE_DISABLE": "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]  # nothing raises
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
    data = json.loads(line[len("REPORT ") :])
    print(data["megatron"]["summary"])  # shown with -s: what docs/hosts.md quotes
    for patch in [p for pl in data["plugins"] for p in pl["patches"]] + data["core_patches"]:
        print(f"  {patch['id']}: {patch['status']} {patch['detail']}")
    return data


def test_megatron_is_the_copy_bundled_in_miles_rl(report):
    found = report["megatron"]
    assert found["kind"] == "bundled" and found["distribution"] == "miles-rl 0.0.2"
    assert (
        found["version"] == "0.16.0rc0" and "bundled in distribution miles-rl" in found["summary"]
    )


def test_plugins_load_and_every_patch_is_applied_or_skipped_with_a_reason(report):
    assert report["active"] and report["plugins"]
    assert {p["name"]: p["state"] for p in report["plugins"]} == {
        p["name"]: "enabled" for p in report["plugins"]
    }
    records = [p for pl in report["plugins"] for p in pl["patches"]] + report["core_patches"]
    for patch in records:
        assert patch["status"] in (APPLIED, SKIPPED, OTHER_LINE), patch
        if patch["status"] == OTHER_LINE:
            # a variant written for a later line (e.g. 0.19's GTP linears) is left out by design;
            # the bundle is judged as the 0.16 line it is a pre-release of
            assert LATER_LINES.fullmatch(patch["detail"]), patch
        if patch["status"] == SKIPPED and patch["target"].startswith("sglang."):
            # miles-rl bundles an SGLang tree too; without SGLang's own dependencies (this venv
            # installs Megatron's only) it does not import, which the skip says
            assert patch["detail"].startswith(("import sglang", "version gate:")), patch
        elif patch["status"] == SKIPPED and patch["target"].startswith("slime."):
            # weight_sync's optional slime patch: slime is not installed next to miles-rl
            assert patch["optional"] and patch["detail"].startswith("import slime"), patch
        elif patch["status"] == SKIPPED and patch["target"].startswith("miles."):
            # weight_sync's optional miles patch: miles-rl is installed here without miles' own
            # dependencies (tqdm, ray), so its update module does not import, which the skip says
            assert patch["optional"] and patch["detail"].startswith("import miles"), patch
        elif patch["status"] == SKIPPED:
            assert patch["detail"].startswith(("signature:", "version gate:")), patch
        if patch["status"] == SKIPPED and patch["detail"].startswith("version gate:"):
            # 0.16.0rc0 is a pre-release of the supported line: only a signature can admit it
            assert "pre-release" in patch["detail"] and not patch["signature"], patch
    status = {p["id"]: p for p in records}
    # miles' _batched_p2p_ops posts its ops without the pipeline group (as slime's patch does):
    # replacing it would move the ops to another group, so pp_rdma leaves it alone.
    order = status["pp_rdma.batched_p2p_order"]
    assert order["status"] == SKIPPED and "prev_pipeline_rank, group" in order["detail"]
    # the code the other plugins rely on is unchanged in miles' copy: they apply
    applied = {pid for pid, p in status.items() if p["status"] == APPLIED}
    assert {"fp8_blockwise.ColumnParallelLinear", "moe_ep_overlap.moe_layer_forward"} <= applied
