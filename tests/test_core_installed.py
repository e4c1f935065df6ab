"""Installed for real in a fresh venv: the core plus the example plugin (and a broken one).

Each probe is a new interpreter that only imports ``megatron.core.parallel_state``: whatever
reaches it comes through the torch.backends entry point (or titan-run), as in a user's job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.testing.freshenv import clean_env, make_venv, pip_install

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).parent / "installed" / "probe.py"
pytestmark = pytest.mark.installed


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    python = make_venv(tmp_path_factory.mktemp("fresh") / "venv")
    pip_install(python, ROOT, ROOT / "tests" / "example_plugin")
    return python


def probe(
    python: Path, *args: str, env: dict[str, str] | None = None, cmd: list[str] | None = None
):
    command = cmd or [str(python), str(PROBE), *args]
    done = subprocess.run(command, env=clean_env(env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, done.stdout + done.stderr
    return lines, done.stderr


def test_entry_points_load(venv):
    """Every declared entry point imports (a broken target would break every import torch)."""
    code = (
        "from importlib import metadata\n"
        "for g in ('torch.backends', 'titan_plugins', 'console_scripts'):\n"
        "    for ep in metadata.entry_points(group=g):\n"
        "        if ep.value.startswith(('titan', 'titan_entrypoints')): ep.load(); print(g, ep.name)\n"
    )
    out = subprocess.run(
        [str(venv), "-c", code], env=clean_env(), capture_output=True, text=True, check=True
    )
    assert "torch.backends titan_plugins" in out.stdout and "titan_plugins example" in out.stdout


def test_plain_import_sees_patch(venv):
    (line,), _ = probe(venv, "plain")
    assert line["patched"] is True
    # megatron.core imports torch, so the hook fires while megatron is already importing
    assert line["autoload"] == "activated (megatron already importing)"
    assert line["plugins"] == {"example": "enabled"}


def test_torch_first_arms_then_activates_on_megatron_import(venv):
    (line,), _ = probe(venv, "torch-first")
    assert line["patched"] is True
    assert line["autoload"] == "activated on first megatron import"


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"TITAN_PLUGINS": "0"}, None),
        ({"TITAN_PLUGINS_DISABLE": "example"}, "TITAN_PLUGINS_DISABLE"),
        ({"TITAN_EXAMPLE": "0"}, "TITAN_EXAMPLE=0"),
    ],
)
def test_switches_remove_the_patch(venv, env, reason):
    (line,), _ = probe(venv, "plain", env=env)
    assert line["patched"] is False
    if reason:
        assert line["plugins"] == {"example": "disabled"} and reason in line["reasons"]["example"]
    else:
        assert line["autoload"] == "off: TITAN_PLUGINS=0"


def test_autoload_off_then_titan_run(venv):
    (off,), _ = probe(venv, "plain", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert off["patched"] is False
    titan_run = str(venv.parent / "titan-run")
    (on,), _ = probe(
        venv,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
        cmd=[titan_run, str(venv), str(PROBE), "plain"],
    )
    assert on["patched"] is True


def test_spawn_child_sees_patch(venv):
    (line,), _ = probe(venv, "spawn")
    assert line["where"] == "spawn-child" and line["patched"] is True


def test_torchrun_workers_see_patch(venv):
    cmd = [
        str(venv),
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29617",
        str(PROBE),
        "torchrun",
    ]
    lines, _ = probe(venv, cmd=cmd)
    assert sorted(line["where"] for line in lines) == ["torchrun-rank0", "torchrun-rank1"]
    assert all(line["patched"] for line in lines)


def test_broken_plugin_leaves_torch_and_others_working(venv):
    pip_install(venv, ROOT / "tests" / "broken_plugin")
    try:
        done = subprocess.run(
            [str(venv), "-c", "import torch; print('torch ok')"],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and "torch ok" in done.stdout
        (line,), stderr = probe(venv, "plain")
        assert line["patched"] is True  # the example plugin still applies
        assert line["plugins"]["broken"] == "failed"
        assert "broken on purpose" in line["reasons"]["broken"]
        listing = subprocess.run(
            [str(venv.parent / "titan-plugins"), "list"],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "broken" in listing.stdout and "failed" in listing.stdout
    finally:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(venv),
                "uninstall",
                "-y",
                "-q",
                "titan-broken-plugin",
            ],
            check=True,
            capture_output=True,
        )
