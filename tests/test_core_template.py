"""scripts/new_plugin.py and plugins/_template/ produce the project's plugin shape, and it works:
no placeholder left, ruff-clean, knobs declared once as typed Settings, its patch applies and
undoes. Its sdist, installed into a fresh venv, runs its own tests: tests/test_core_installed.py.
"""

from __future__ import annotations

import configparser
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.activation import register_patches
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.manager import get_plugin_manager
from titan_plugins.patching import PatchEngine
from titan_plugins.settings import Setting
from titan_plugins.testing import fake_entry_point
from titan_plugins.verify import selection

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "new_plugin.py"
NAME = "my_feature"
SHAPE = [
    "LICENSE",
    "MANIFEST.in",
    "README.md",
    "setup.cfg",
    "setup.py",
    "tests/conftest.py",
    f"tests/test_{NAME}_plugin.py",
    f"titan_{NAME}/__init__.py",
    f"titan_{NAME}/patches.py",
    f"titan_{NAME}/plugin.py",
    f"titan_{NAME}/settings.py",
    f"titan_{NAME}/upstream_tests.json",
    f"titan_{NAME}/version.py",
]


def generate(name: str, into: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), name, "--into", str(into)], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[Path, str]:
    into = tmp_path_factory.mktemp("generated")
    done = generate(NAME, into)
    assert done.returncode == 0, done.stderr
    return into / NAME, done.stdout


def test_generator_output_has_the_project_shape(generated):
    plugin_dir, printed = generated
    files = sorted(str(p.relative_to(plugin_dir)) for p in plugin_dir.rglob("*") if p.is_file())
    assert files == SHAPE
    texts = {name: (plugin_dir / name).read_text() for name in files}
    assert not [n for n, t in texts.items() if "PLUGIN_" in t or "PLUGIN-" in t]
    assert texts["LICENSE"] == (ROOT / "LICENSE").read_text()
    cfg = configparser.ConfigParser()
    cfg.read_string(texts["setup.cfg"])
    root_cfg = configparser.ConfigParser()
    root_cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["name"] == "titan-my-feature"
    assert cfg["metadata"]["version"] == f"attr: titan_{NAME}.version.__version__"
    for key in ("license_expression", "license_files", "classifiers"):
        assert cfg["metadata"][key] == root_cfg["metadata"][key], key
    assert cfg["options"]["python_requires"] == root_cfg["options"]["python_requires"]
    megatron = root_cfg["options.extras_require"]["megatron"]
    assert cfg["options.extras_require"]["megatron"] == megatron
    assert cfg["options.entry_points"]["titan_plugins"].split() == [
        NAME,
        "=",
        f"titan_{NAME}.plugin",
    ]
    assert "graft tests" in texts["MANIFEST.in"]  # its tests run from its sdist
    assert 'pytest_plugins = ["titan_plugins.testing.pytest_plugin"]' in texts["tests/conftest.py"]
    assert "from titan_plugins import hookimpl" in texts[f"titan_{NAME}/plugin.py"]
    assert "TITAN_MY_FEATURE_LOG_EVERY" in texts[f"titan_{NAME}/settings.py"]
    assert "TITAN_MY_FEATURE=0" in texts["README.md"]
    # the install line works from anywhere: no repository venv, an absolute path
    assert ".venv/bin" not in printed
    assert f"python -m pip install -e {plugin_dir.resolve()}" in printed


def test_generator_output_is_ruff_clean(generated):
    plugin_dir, _ = generated
    config = ["--config", str(ROOT / "ruff.toml")]
    for command in (["check", "--no-cache", *config], ["format", "--check", *config]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *command, str(plugin_dir)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_knobs_are_typed_settings_read_only_through_them(generated, monkeypatch):
    plugin_dir, _ = generated
    monkeypatch.syspath_prepend(str(plugin_dir))
    settings = importlib.import_module(f"titan_{NAME}.settings")
    plugin = importlib.import_module(f"titan_{NAME}.plugin")
    assert settings.SETTINGS and all(isinstance(s, Setting) for s in settings.SETTINGS)
    assert plugin.titan_settings() is settings.SETTINGS
    package = plugin_dir / f"titan_{NAME}"
    raw_reads = re.compile(r"os\.environ[\[.]|getenv\(|\benv_(bool|int|float|choice|list|bytes)\b")
    for source in package.glob("*.py"):
        assert not raw_reads.search(source.read_text()), source.name
    version = importlib.import_module(f"titan_{NAME}")
    assert version.__version__ == "0.1.0"
    assert [p.name for p in package.glob("*.py") if "__version__ =" in p.read_text()] == [
        "version.py"
    ]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("plugins", "reserved"),
        ("plugins_debug", "reserved"),
        ("My-Plugin", "lower snake case"),
        ("9lives", "lower snake case"),
        ("my__plugin", "lower snake case"),
        ("fp8_blockwise", "belongs to this project's distribution titan-fp8-blockwise"),
        ("rewind", "belongs to this project's distribution titan-rewind"),
    ],
)
def test_generator_refuses_names_the_registry_would_refuse(tmp_path, name, why):
    done = generate(name, tmp_path)
    assert done.returncode == 2 and why in done.stderr
    assert not list(tmp_path.iterdir())


def test_first_party_names_are_for_this_repositorys_plugins_folder():
    spec = importlib.util.spec_from_file_location("new_plugin", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.name_refusal("rewind", ROOT / "plugins") is None
    assert "belongs to" in script.name_refusal("rewind", ROOT / "elsewhere")


def test_generator_output_loads_and_patches(generated, monkeypatch):
    plugin_dir, _ = generated
    monkeypatch.syspath_prepend(str(plugin_dir))
    for var in ("TITAN_PLUGINS", "TITAN_MY_FEATURE", "TITAN_MY_FEATURE_LOG_EVERY"):
        monkeypatch.delenv(var, raising=False)
    pm = get_plugin_manager(entry_points=[fake_entry_point(NAME, f"titan_{NAME}.plugin")])
    assert pm.records[NAME].state == "enabled"
    import megatron.core.parallel_state as ps

    original = ps.initialize_model_parallel
    engine = PatchEngine()
    register_patches(pm, engine, errors := [])  # the module is imported: applied at once
    try:
        (patch,) = [p for p in engine.patches() if p.plugin == NAME]
        assert patch.status == "applied" and not errors  # its signature held, too
        # what test_core_ledger.py asks of every plugin in this repository
        assert patch.requires == (SUPPORTED_MEGATRON,) and patch.signature
        # and its upstream_tests.json names a Megatron-LM test file that exercises the patch
        data = plugin_dir / f"titan_{NAME}" / selection.DATA_FILE
        assert selection.read(data).coverage([patch]).covered == {
            patch.id: ("tests/unit_tests/test_parallel_state.py",)
        }
        assert ps.initialize_model_parallel.__wrapped__ is original
    finally:
        engine.undo()
    assert ps.initialize_model_parallel is original


def test_generated_conftest_also_works_below_this_repositorys_root_conftest(generated, tmp_path):
    """pytest refuses ``pytest_plugins`` in a conftest found during collection; inside the
    repository (root conftest on top) the generated conftest must leave it to the root one."""
    plugin_dir, _ = generated
    for name in ("conftest.py", "pytest.ini"):
        shutil.copy(ROOT / name, tmp_path / name)
    tests = tmp_path / "plugins" / NAME / "tests"
    tests.mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    shutil.copy(plugin_dir / "tests" / "conftest.py", tests / "conftest.py")
    (tests / f"test_{NAME}_fixture.py").write_text("def test_pool(gloo_pool1):\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"test_{NAME}_fixture.py::test_pool" in done.stdout
