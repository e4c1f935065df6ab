"""Every distribution is shippable, and docs/core-api.md says what the code does.

Distributions: each sdist is built for real (``setup.py sdist`` on a copy of the folder) and its
file list and PKG-INFO checked: the license text and ``License-Expression``, one version (its
``version.py``), the same ``Requires-Python`` and Python classifiers everywhere, the supported
Megatron as a ``megatron`` extra equal to ``SUPPORTED_MEGATRON``, only its own packages, and no
tests (this repository's tests run from a checkout: the root conftest loads the shared fixtures,
some read ../shared data; the template's tests, which do run from an sdist, are checked by
tests/test_core_installed.py).

Docs: the API the page names exists (imports, Patch fields, hooks), its examples run and are
ruff-clean, and the tutorial's plugin is what tests/test_core_installed.py installs.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import email
import importlib
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from titan_plugins import hookspecs
from titan_plugins.patching import Patch

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "core-api.md"
DISTRIBUTIONS = [ROOT] + sorted(
    p.parent for p in ROOT.glob("plugins/*/setup.cfg") if not p.parent.name.startswith("_")
)
IDS = [d.name if d != ROOT else "titan-plugins" for d in DISTRIBUTIONS]
LICENSE = (ROOT / "LICENSE").read_text()
PYTHON_CLASSIFIERS = {
    "Programming Language :: Python :: 3",
    "Programming Language :: Python :: 3 :: Only",
    "Programming Language :: Python :: 3.11",
}
BUILD_LEFTOVERS = (
    "*.egg-info",
    "build",
    "dist",
    "__pycache__",
    ".venv",
    ".venv-*",
    ".git",
    "*_cache",
)


@dataclasses.dataclass
class Sdist:
    """A built sdist: member paths relative to its top folder, and its PKG-INFO."""

    members: dict[str, bytes]
    info: email.message.Message

    def requirement(self, name: str, extra: str | None = None) -> Requirement:
        """The one Requires-Dist on ``name`` (for ``extra``, or unconditional)."""
        found = []
        for line in self.info.get_all("Requires-Dist") or []:
            req = Requirement(line)
            in_extra = req.marker is not None and req.marker.evaluate({"extra": extra or ""})
            if req.name == name and (in_extra if extra else req.marker is None):
                found.append(req)
        assert len(found) == 1, f"{name} (extra {extra}) in {self.info.get_all('Requires-Dist')}"
        return found[0]


def build_sdist(source: Path, workdir: Path) -> Sdist:
    """Build ``source``'s sdist from a copy (nothing is written into the checkout)."""
    copy = workdir / "src"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS, "plugins"))
    out = workdir / "dist"
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(out)],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (tarball,) = out.glob("*.tar.gz")
    with tarfile.open(tarball) as tar:
        members = {
            m.name.split("/", 1)[1]: tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.isfile()
        }
    return Sdist(members, email.message_from_bytes(members["PKG-INFO"]))


@pytest.fixture(scope="module")
def sdists(tmp_path_factory) -> dict[Path, Sdist]:
    """Every distribution's sdist, built two at a time (each build is its own process)."""
    work = [(d, tmp_path_factory.mktemp(name)) for d, name in zip(DISTRIBUTIONS, IDS)]
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda job: build_sdist(*job), work))
    return dict(zip(DISTRIBUTIONS, built))


def package_of(dist: Path) -> str:
    """The distribution's main package: titan_plugins or titan_<plugin>."""
    return "titan_plugins" if dist == ROOT else f"titan_{dist.name}"


def version_py(dist: Path) -> str:
    """``__version__`` of the distribution's version.py, read without importing it."""
    tree = ast.parse((dist / package_of(dist) / "version.py").read_text())
    (value,) = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and node.targets[0].id == "__version__"
    ]
    return value


# ------------------------------------------------------------------------------ distributions
@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=IDS)
def test_license_in_sdist_and_metadata(sdists, dist):
    sdist = sdists[dist]
    assert sdist.members.get("LICENSE", b"").decode() == LICENSE  # the full Apache-2.0 text
    assert sdist.info["License-Expression"] == "Apache-2.0"
    assert sdist.info.get_all("License-File") == ["LICENSE"]


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=IDS)
def test_sdist_ships_no_tests_and_only_its_own_packages(sdists, dist):
    names = sdists[dist].members
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]
    (top_level,) = [v for n, v in names.items() if n.endswith(".egg-info/top_level.txt")]
    own = {"titan_plugins", "titan_entrypoints"} if dist == ROOT else {package_of(dist)}
    assert set(top_level.decode().split()) == own


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=IDS)
def test_sdist_ships_sources_not_binaries(sdists, dist):
    """A native extension travels as its C source (built at install); no built object ships."""
    names = sdists[dist].members
    assert not [n for n in names if n.endswith((".so", ".pyd", ".o", ".dylib"))]
    sources = sorted(str(p.relative_to(dist)) for p in (dist / package_of(dist)).rglob("*.c"))
    assert [n for n in sources if n not in names] == []


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=IDS)
def test_sdist_ships_the_upstream_test_selection(sdists, dist):
    """``upstream_tests.json`` (tests/test_verify_selection.py) is package data: in the sdist,
    and from there in the wheel (``[options.package_data]``)."""
    package = "titan_plugins/hosts/megatron" if dist == ROOT else package_of(dist)
    assert f"{package}/upstream_tests.json" in sdists[dist].members


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=IDS)
def test_one_version_source(sdists, dist):
    package = dist / package_of(dist)
    assert sdists[dist].info["Version"] == version_py(dist)
    cfg = configparser.ConfigParser()
    cfg.read(dist / "setup.cfg")
    assert cfg["metadata"]["version"] == f"attr: {package_of(dist)}.version.__version__"
    literal = re.compile(r"^__version__\s*=", re.M)
    assert [p.name for p in package.rglob("*.py") if literal.search(p.read_text())] == [
        "version.py"
    ]
    assert "import __version__" in (package / "__init__.py").read_text()


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=IDS)
def test_python_support_is_stated_the_same_everywhere(sdists, dist):
    info = sdists[dist].info
    assert info["Requires-Python"] == ">=3.11"
    python = {c for c in info.get_all("Classifier") if c.startswith("Programming Language")}
    assert python == PYTHON_CLASSIFIERS
    assert not [c for c in info.get_all("Classifier") if c.startswith("License ::")]


@pytest.mark.parametrize("dist", DISTRIBUTIONS[1:], ids=IDS[1:])
def test_plugin_requires_a_core_range_holding_this_core(sdists, dist):
    core = sdists[dist].requirement("titan-plugins")
    assert version_py(ROOT) in core.specifier


def core_megatron_range() -> SpecifierSet:
    """The core's supported range (the Megatron host room's ``SUPPORTED_MEGATRON``, a gate)."""
    from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON as value

    return Requirement(value).specifier if value[0].isalpha() else SpecifierSet(value)


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=IDS)
def test_megatron_range_is_an_extra_equal_to_the_supported_one(sdists, dist):
    """``pip install 'titan-x[megatron]'`` installs the megatron-core every patch is gated on
    (``SUPPORTED_MEGATRON``: test_core_ledger.py holds each patch to it); without the extra
    nothing requires megatron-core, so a Megatron-LM checkout on PYTHONPATH still works."""
    sdist = sdists[dist]
    assert sdist.requirement("megatron-core", extra="megatron").specifier == core_megatron_range()
    requires = sdist.info.get_all("Requires-Dist") or []
    assert not [r for r in requires if "megatron" in r and ";" not in r]


def test_every_distribution_has_the_same_license_file():
    for folder in [ROOT, *sorted((ROOT / "plugins").iterdir())]:
        if (folder / "setup.cfg").is_file():
            assert (folder / "LICENSE").read_text() == LICENSE, folder


# ------------------------------------------------------------------------------ docs/core-api.md
FENCE = re.compile(r"^```(\w+)(?: file=(\S+))?\n(.*?)^```$", re.M | re.S)


def doc_blocks() -> list[tuple[str, str | None, str]]:
    """Every top-level fenced block of the page: (language, file name or None, text)."""
    return [(m[1], m[2], m[3]) for m in FENCE.finditer(DOC.read_text())]


def tutorial_files() -> dict[str, str]:
    """The tutorial's files, as the reader copies them."""
    return {name: text for _, name, text in doc_blocks() if name}


def section(title: str) -> str:
    """The text of one ``## title`` section."""
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_documented_imports_exist():
    imports = set(re.findall(r"from (titan_plugins[\w.]*) import ([\w, ]+)", DOC.read_text()))
    assert ("titan_plugins.doctor", "Check, OK, WARN, FAIL") in imports
    for module, names in imports:
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip()), (module, name)


def test_patch_block_documents_every_field_and_which_are_required():
    (block,) = [t for lang, _, t in doc_blocks() if lang == "python" and t.startswith("Patch(")]
    documented = re.findall(r"^    (\w+)=", block, re.M)
    fields = [f.name for f in dataclasses.fields(Patch) if f.init]
    internal = {"plugin", "status", "detail"}  # set by the core, not by the author
    assert sorted(documented) == sorted(set(fields) - internal)
    required = [f.name for f in dataclasses.fields(Patch) if f.default is dataclasses.MISSING]
    for name in required:
        if name in ("rationale", "remove_when"):
            assert re.search(rf"^    {name}=.*# required", block, re.M), name


def test_every_hook_is_documented():
    text = section("Hooks")
    missing = [n for n in dir(hookspecs) if n.startswith("titan_") and f"`{n}(" not in text]
    assert not missing


def test_hook_examples_are_the_tutorials_code():
    (example,) = re.findall(r"  ```python\n(.*?)  ```", section("Hooks"), re.S)
    plugin = tutorial_files()["titan_step_stats/plugin.py"]
    for function in textwrap.dedent(example).split("\n\n\n"):
        assert function.strip() in plugin


def test_settings_example_runs(monkeypatch):
    (block,) = [t for lang, _, t in doc_blocks() if lang == "python" and "BUDGET" in t]
    for var in ("TITAN_MY_PLUGIN_CHUNK", "TITAN_MY_PLUGIN_MODE", "TITAN_MY_PLUGIN_BUDGET"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TITAN_MY_PLUGIN_BUDGET", "512M")
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["chunks"] == 4 and namespace["BUDGET"].read() == 512 << 20


def test_tutorial_is_complete_and_ruff_clean(tmp_path):
    files = tutorial_files()
    assert sorted(files) == [
        "README.md",
        "setup.cfg",
        "setup.py",
        "tests/conftest.py",
        "tests/test_step_stats.py",
        "titan_step_stats/__init__.py",
        "titan_step_stats/patches.py",
        "titan_step_stats/plugin.py",
        "titan_step_stats/settings.py",
        "titan_step_stats/version.py",
    ]
    assert 'pytest_plugins = ["titan_plugins.testing.pytest_plugin"]' in files["tests/conftest.py"]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    ruff = [sys.executable, "-m", "ruff"]
    config = ["--config", str(ROOT / "ruff.toml")]
    for command in (["check", *config, "--no-cache"], ["format", "--check", *config]):
        done = subprocess.run([*ruff, *command, "."], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
