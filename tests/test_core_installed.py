"""Installed for real in one fresh venv: the core, the example plugin (and a broken one), and
two plugins written outside the repository as an author would: the tutorial of
docs/core-api.md, built from the page's own code blocks (so the page cannot drift), and the
output of scripts/new_plugin.py, packed as an sdist, installed from it and tested from it.

Each probe is a new interpreter that only imports ``megatron.core.parallel_state``: whatever
reaches it comes through the torch.backends entry point (or titan-run), as in a user's job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from titan_plugins.testing.freshenv import clean_env, make_venv, pip_install

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).parent / "installed" / "probe.py"
DOC = ROOT / "docs" / "core-api.md"
FENCE = re.compile(r"^```\w+ file=(\S+)\n(.*?)^```$", re.M | re.S)
PACKAGED = "packaged_feature"  # the template's output, installed from its sdist
pytestmark = pytest.mark.installed


def write_tutorial(folder: Path) -> Path:
    """docs/core-api.md's tutorial plugin, file by file as a reader copies it, plus a LICENSE."""
    for name, text in FENCE.findall(DOC.read_text()):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    shutil.copy(ROOT / "LICENSE", folder / "LICENSE")
    return folder


def packaged_template(work: Path) -> tuple[Path, Path]:
    """Generate a plugin, build its sdist, unpack it: (the sdist, the unpacked folder)."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "new_plugin.py"), PACKAGED, "--into", str(work)],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(work / "dist")],
        cwd=work / PACKAGED,
        check=True,
        capture_output=True,
    )
    (sdist,) = (work / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    return sdist, unpacked


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> dict[str, Path]:
    """The plugins built outside the repository (one set for the module)."""
    work = tmp_path_factory.mktemp("outside")
    sdist, unpacked = packaged_template(work)
    return {"tutorial": write_tutorial(work / "step-stats"), "sdist": sdist, "unpacked": unpacked}


@pytest.fixture(scope="module")
def venv(tmp_path_factory, outside):
    """One fresh venv for the module: installs cost seconds each, so every test shares it."""
    python = make_venv(tmp_path_factory.mktemp("fresh") / "venv")
    example = ROOT / "tests" / "example_plugin"
    pip_install(python, ROOT, example, outside["tutorial"], outside["sdist"])
    return python


def run(venv: Path, *command: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run a command of the venv (``python`` or one of its scripts) with a clean environment,
    from outside the checkout (``python -c`` / ``-m`` put the working directory on sys.path)."""
    program = str(venv) if command[0] == "python" else str(venv.parent / command[0])
    return subprocess.run(
        [program, *command[1:]],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd or venv.parents[2],
    )


def probe(
    python: Path, *args: str, env: dict[str, str] | None = None, cmd: list[str] | None = None
):
    command = cmd or [str(python), str(PROBE), *args]
    done = subprocess.run(
        command,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=python.parents[2],  # not the checkout: its titan_plugins/ would shadow the installed
    )
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
    out = run(venv, "python", "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch.backends titan_plugins" in out.stdout and "titan_plugins example" in out.stdout
    assert "titan_plugins step_stats" in out.stdout and f"titan_plugins {PACKAGED}" in out.stdout


def test_plain_import_sees_patch(venv):
    """Also docs/core-api.md's tutorial claim: a bad knob value warns at the first ``import
    megatron``, naming the variable and what is accepted, and switches nothing off."""
    (line,), stderr = probe(venv, "plain", env={"TITAN_STEP_STATS_EVERY": "0"})
    assert line["patched"] is True
    # megatron.core imports torch, so the hook fires while megatron is already importing
    assert line["autoload"] == "activated (megatron already importing)"
    assert line["plugins"] == {"example": "enabled", "step_stats": "enabled", PACKAGED: "enabled"}
    assert "TITAN_STEP_STATS_EVERY='0': below the minimum 1; accepted: an integer >= 1" in stderr


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
        assert line["plugins"]["example"] == "disabled" and reason in line["reasons"]["example"]
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
        done = run(venv, "python", "-c", "import torch; print('torch ok')")
        assert done.returncode == 0 and "torch ok" in done.stdout
        (line,), stderr = probe(venv, "plain")
        assert line["patched"] is True  # the example plugin still applies
        assert line["plugins"]["broken"] == "failed"
        assert "broken on purpose" in line["reasons"]["broken"]
        listing = run(venv, "titan-plugins", "list")
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


# ------------------------------------------------------------------ plugins built outside the repo
def test_installed_distributions_carry_their_license_and_version(venv):
    code = (
        "import json\n"
        "from importlib import metadata\n"
        "for name in ('titan-plugins', 'titan-step-stats', 'titan-packaged-feature'):\n"
        "    d = metadata.distribution(name)\n"
        "    files = [str(f) for f in d.files or [] if str(f).endswith('LICENSE')]\n"
        "    print('PROBE ' + json.dumps([name, d.version, d.metadata['License-Expression'], files]))\n"
    )
    done = run(venv, "python", "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert [row[:3] for row in rows] == [
        ["titan-plugins", "0.1.0", "Apache-2.0"],
        ["titan-step-stats", "0.1.0", "Apache-2.0"],
        ["titan-packaged-feature", "0.1.0", "Apache-2.0"],
    ]
    assert all(row[3] and row[3][0].endswith(".dist-info/licenses/LICENSE") for row in rows)


def test_docs_tutorial_plugin_is_listed_documented_and_switched_off(venv):
    listed = run(venv, "titan-plugins", "list")
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "- step_stats  [titan-step-stats 0.1.0]  enabled" in listed.stdout
    assert "titan_train_step" in listed.stdout and "titan_optimizer_step" in listed.stdout
    assert "    every: 10" in listed.stdout  # its titan_report
    assert "patch step_stats.remember_layout -> megatron.core.parallel_state:" in listed.stdout
    documented = run(venv, "titan-plugins", "env")
    assert documented.returncode == 0, documented.stderr[-3000:]
    for line in (
        "TITAN_STEP_STATS=(unset)  default 1",
        "TITAN_STEP_STATS_EVERY=(unset)  default 10",
    ):
        assert line in documented.stdout
    off = run(venv, "titan-plugins", "list", env={"TITAN_STEP_STATS": "0"})
    assert off.returncode == 0, off.stderr[-3000:]
    assert "- step_stats  [titan-step-stats 0.1.0]  disabled (TITAN_STEP_STATS=0)" in off.stdout


def test_docs_tutorial_knob_is_an_error_at_import_megatron_under_strict(venv):
    """(The warning without STRICT: test_plain_import_sees_patch.)"""
    env = {"TITAN_STEP_STATS_EVERY": "0", "TITAN_PLUGINS_STRICT": "1"}
    strict = run(venv, "python", "-c", "import megatron.core", env=env)
    assert strict.returncode == 1
    assert "SettingError" in strict.stderr and "TITAN_STEP_STATS_EVERY='0'" in strict.stderr


def test_plugins_built_outside_pass_their_own_tests(venv, outside):
    """The tutorial's tests (its conftest loads the core's pytest plugin; its patch applies) and
    the template's tests, run from the unpacked sdist as a packager would, against the installed
    plugins."""
    tests = [str(outside["tutorial"] / "tests"), str(outside["unpacked"] / "tests")]
    done = run(
        venv,
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *tests,
        cwd=outside["tutorial"].parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The tutorial's 2 tests and the template's 4 (one reads its upstream_tests.json through
    # the installed package).
    assert "6 passed" in done.stdout
