"""The import rules of docs/architecture.md.

A plugin (every file under ``plugins/<name>/``: package, tests, tools) never imports another
plugin's package, nor a private module of the core (``titan_plugins._x``, ``titan_plugins.a._x``):
shared code moves into the core's public modules. The core (``titan_plugins``, ``entrypoints``)
never imports a plugin. Checked on the source (AST, nothing imported); imports by string
(``importlib.import_module``, ``__import__``) count too; the checker is tested on a bad fixture.
And ``import torch`` (the autoload entry point) imports neither megatron nor any plugin.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = "titan_plugins"


def plugin_packages(plugins_dir: Path) -> dict[Path, set[str]]:
    """Each plugin folder (one with a setup.cfg) -> the top-level packages it ships."""
    found: dict[Path, set[str]] = {}
    for folder in sorted(p for p in plugins_dir.iterdir() if (p / "setup.cfg").is_file()):
        found[folder] = {
            p.name
            for p in folder.iterdir()
            if (p / "__init__.py").is_file() and p.name not in ("tests", "test")
        }
    return found


def imported_names(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """(line, dotted names) of every absolute import statement.

    ``from a import b, c`` gives ``[a, a.b, a.c]`` (the module first): ``b`` may be a module.
    """
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
            found.append((node.lineno, [node.module, *names]))
        elif isinstance(node, ast.Call) and node.args and _is_import_call(node.func):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, [first.value]))
    return found


def _is_import_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def problem(name: str, own: set[str], plugins: set[str]) -> str | None:
    """Why a plugin that ships packages ``own`` may not import ``name``, or None."""
    parts = name.split(".")
    if parts[0] in plugins - own:
        return f"imports another plugin ({parts[0]})"
    if parts[0] == CORE and any(_private(p) for p in parts[1:]):
        return "imports a private core module"
    return None


def violations(plugins_dir: Path) -> list[str]:
    """Every forbidden import under ``plugins_dir``, as ``path:line: name: why``."""
    packages = plugin_packages(plugins_dir)
    every = set().union(*packages.values()) if packages else set()
    found = []
    for folder, own in packages.items():
        for path in sorted(folder.rglob("*.py")):
            if any(part.endswith(".egg-info") or part == "build" for part in path.parts):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            where = path.relative_to(plugins_dir.parent)
            for line, (module, *names) in imported_names(tree):
                # the module's own problem, else each imported name's (``from core import _x``)
                checked = [module] if problem(module, own, every) else names
                for name in checked:
                    why = problem(name, own, every)
                    if why:
                        found.append(f"{where}:{line}: {name}: {why}")
    return sorted(set(found))


def test_plugins_import_no_other_plugin_and_no_private_core_module() -> None:
    assert plugin_packages(ROOT / "plugins"), (
        "no plugin found: the checker looks in the wrong place"
    )
    assert violations(ROOT / "plugins") == []


def test_the_core_imports_no_plugin() -> None:
    plugins = set().union(*plugin_packages(ROOT / "plugins").values())
    found = []
    for folder in (ROOT / CORE, ROOT / "entrypoints"):
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for line, (module, *_) in imported_names(tree):
                if module.split(".")[0] in plugins:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert found == []


def test_import_torch_imports_neither_megatron_nor_plugins() -> None:
    """The torch.backends entry point only arms a trigger (standard library only): neither
    megatron, nor a plugin, nor the core's manager and engine load at ``import torch``."""
    plugins = sorted(set().union(*plugin_packages(ROOT / "plugins").values()))
    heavy_core = ["titan_plugins.activation", "titan_plugins.manager", "titan_plugins.patching"]
    code = (
        "import sys, torch\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {['megatron', *plugins]!r}\n"
        f"       or m in {heavy_core!r}]\n"
        "from titan_plugins import autoload\n"
        "print(autoload.armed().state.split(':')[0], bad)\n"
    )
    env = {**os.environ, "TITAN_PLUGINS_AUTOLOAD": "1", "TITAN_PLUGINS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["armed", "[]"], out.stderr


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def bad_tree(tmp_path: Path) -> Path:
    """Two fake plugins; ``alpha`` breaks every rule once, ``beta`` keeps them."""
    plugins = tmp_path / "plugins"
    for name in ("alpha", "beta"):
        _write(plugins, f"{name}/setup.cfg", "[metadata]\n")
        _write(plugins, f"{name}/titan_{name}/__init__.py", "")
    _write(
        plugins,
        "alpha/titan_alpha/plugin.py",
        "import importlib\n"
        "import titan_beta.core\n"  # line 2: another plugin
        "from titan_plugins import _log, hookimpl, __version__\n"  # 3: private (only _log)
        "from titan_plugins.testing._post_import import watch\n"  # 4: private submodule
        "from titan_plugins.schedule import Unit\n"  # public: fine
        "from . import helpers\n"  # relative, own package: fine
        "from titan_alpha import helpers\n"  # own package: fine
        "mod = importlib.import_module('titan_beta.plugin')\n",  # 8: by string
    )
    _write(plugins, "alpha/tests/test_alpha.py", "from titan_beta import x\n")  # tests count
    _write(plugins, "alpha/titan_alpha.egg-info/junk.py", "import titan_beta\n")  # build output
    _write(plugins, "beta/titan_beta/plugin.py", "from titan_plugins import hookimpl\n")
    return plugins


def test_checker_flags_each_bad_import(bad_tree: Path) -> None:
    assert plugin_packages(bad_tree) == {
        bad_tree / "alpha": {"titan_alpha"},
        bad_tree / "beta": {"titan_beta"},
    }
    assert violations(bad_tree) == [
        "plugins/alpha/tests/test_alpha.py:1: titan_beta: imports another plugin (titan_beta)",
        "plugins/alpha/titan_alpha/plugin.py:2: titan_beta.core: imports another plugin "
        "(titan_beta)",
        "plugins/alpha/titan_alpha/plugin.py:3: titan_plugins._log: imports a private core module",
        "plugins/alpha/titan_alpha/plugin.py:4: titan_plugins.testing._post_import: imports a "
        "private core module",
        "plugins/alpha/titan_alpha/plugin.py:8: titan_beta.plugin: imports another plugin "
        "(titan_beta)",
    ]


KNOB_READ = re.compile(r"""(os\.environ(\.get)?\s*[\[(]|getenv\()\s*f?["']TITAN_""")


def test_each_plugin_declares_its_knobs_once_in_settings_py() -> None:
    # issue 11: one typed list per plugin (settings.py: SETTINGS), read only through it. A
    # TITAN_ variable read straight from the environment anywhere else is a second declaration
    # that doctor, `titan-plugins env` and STRICT never see.
    for folder, packages in plugin_packages(ROOT / "plugins").items():
        if folder.name.startswith("_"):
            continue
        for package in packages:
            settings = folder / package / "settings.py"
            assert settings.is_file(), f"{folder.name}: knobs belong in {package}/settings.py"
            assert "SETTINGS" in settings.read_text(), settings
            for source in (folder / package).rglob("*.py"):
                for number, line in enumerate(source.read_text().splitlines(), 1):
                    rel = source.relative_to(ROOT)
                    assert not KNOB_READ.search(line), f"{rel}:{number}: raw knob read: {line}"


def test_knob_read_pattern_catches_raw_reads() -> None:
    assert KNOB_READ.search('x = os.environ.get("TITAN_FOO", "1")')
    assert KNOB_READ.search("os.environ['TITAN_FOO']")
    assert KNOB_READ.search('os.getenv("TITAN_FOO")')
    assert not KNOB_READ.search('os.environ.get("LOCAL_WORLD_SIZE", "1")')
