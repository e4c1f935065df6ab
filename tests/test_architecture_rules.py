"""The import rules of docs/architecture.md.

A plugin (every file under ``plugins/<name>/``: package, tests, tools) never imports another
plugin's package, nor a private module of the core (``titan_plugins._x``, ``titan_plugins.a._x``):
shared code moves into the core's public modules. The core (``titan_plugins``, ``entrypoints``)
never imports a plugin. Checked on the source (AST, nothing imported); imports by string
(``importlib.import_module``, ``__import__``) count too; the checker is tested on a bad fixture.
And ``import torch`` (the autoload entry point) imports neither megatron nor any plugin.

No distribution's import graph has a cycle (the core's: issue 30 item 7; each plugin's: issue
46 item 10), and the core is host-neutral: what
is Megatron-specific lives in the Megatron host's room (``titan_plugins/hosts/megatron/``), which
the rest of the core reaches only through ``titan_plugins.hosts.HOSTS``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

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
        "from titan_plugins.hosts.megatron.schedule import Unit\n"  # public: fine
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


# ---------------------------------------------------------------- each distribution's import graph
def package_modules(package: str, folder: Path) -> dict[str, Path]:
    """Every module of package ``package``, whose files lie under ``folder``, by dotted name."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def core_modules(root: Path) -> dict[str, Path]:
    """Every module of the ``titan_plugins`` package under ``root``, by dotted name."""
    return package_modules(CORE, root / CORE)


def distribution_modules(root: Path) -> dict[str, dict[str, Path]]:
    """Each distribution of the tree under ``root`` -> its modules by dotted name: the core
    (``titan_plugins``) and each plugin (the packages of ``plugins/<name>/``; its tests and
    tools are no part of it)."""
    found = {"titan-plugins (the core)": core_modules(root)}
    for folder, packages in plugin_packages(root / "plugins").items():
        found[folder.name] = {
            name: path
            for package in sorted(packages)
            for name, path in package_modules(package, folder / package).items()
        }
    return found


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _runtime_nodes(node: ast.AST) -> list[ast.AST]:
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:`` blocks (their
    ``else`` runs). Function bodies count: an import there still runs, later."""
    found: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        if _type_checking(child):
            for other in child.orelse:  # type: ignore[attr-defined]
                found += [other, *_runtime_nodes(other)]
            continue
        found += [child, *_runtime_nodes(child)]
    return found


def module_imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything module ``name`` imports when it runs.

    ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module); relative imports are
    resolved against the module's package; ``importlib.import_module("x")`` / ``__import__("x")``
    with a constant string count. A package's lazy table (``titan_plugins/__init__.py``:
    ``_LAZY``, resolved by ``__getattr__`` on attribute access) is data, not an import: it runs
    only after the package has finished importing, so it can never close an import-time cycle
    (``test_the_package_imports_nothing_at_import_time`` keeps that package a leaf). A plugin
    package's lazy attributes written as code (a module-level ``__getattr__`` in its
    ``__init__.py``, PEP 562) are the same table and left out for the same reason.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    if path.name == "__init__.py":
        tree.body = [
            node
            for node in tree.body
            if not (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
        ]
    found: list[tuple[int, str]] = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([module] if module else [])])
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and _is_import_call(node.func):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, first.value))
    return found


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {core module it imports: first line}, over the ``titan_plugins`` tree."""
    return module_graph(core_modules(root))


def module_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module of ``modules`` it imports: first line}: the graph inside one
    distribution (an import of another distribution cannot close a circle inside this one)."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for line, target in module_imports(name, path):
            if target in modules and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def import_groups(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each group of modules that import each other in a circle (strongly connected), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the core is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(sorted(group) for group in groups)


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each of :func:`import_groups` (first module repeated last),
    found from the group's first module in sorted order; [] when the graph is acyclic."""
    cycles = []
    for group in import_groups(graph):
        start = min(group)
        paths = {start: [start]}
        queue = [start]
        while queue:  # breadth first: the shortest way back to ``start`` inside the group
            v = queue.pop(0)
            if start in graph[v]:
                cycles.append([*paths[v], start])
                break
            for w in sorted(graph[v]):
                if w in group and w not in paths:
                    paths[w] = [*paths[v], w]
                    queue.append(w)
    return cycles


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return (
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:]))
        + f" -> {cycle[-1]}"
    )


def circles(root: Path) -> list[str]:
    """Each import circle inside a distribution of the tree under ``root``: the distribution,
    the modules of the circle's group and one shortest cycle through them, in order."""
    found = []
    for distribution, modules in distribution_modules(root).items():
        graph = module_graph(modules)
        for group, cycle in zip(import_groups(graph), import_cycles(graph)):
            found.append(
                f"{distribution}: {len(group)} modules import each other in a circle: "
                f"{', '.join(group)}\n  e.g. {describe_cycle(cycle, graph)}"
            )
    return found


def test_no_distribution_import_graph_has_a_cycle() -> None:
    distributions = distribution_modules(ROOT)
    core = module_graph(distributions["titan-plugins (the core)"])
    assert len(core) > 40 and core["titan_plugins.activation"], "the checker sees no core"
    assert len(distributions) >= 8 and all(distributions.values()), "a plugin is missing"
    found = circles(ROOT)
    assert not found, (
        "a distribution's modules import each other in a circle (move what they share to a "
        "leaf module):\n" + "\n".join(found)
    )


def test_the_package_imports_nothing_at_import_time() -> None:
    # Why the lazy table may be left out of the graph: the package itself imports only its
    # version at import time, and every public name resolves after the package is complete.
    assert set(import_graph(ROOT)["titan_plugins"]) == {"titan_plugins.version"}


@pytest.fixture
def cyclic_tree(tmp_path: Path) -> Path:
    """A fake core: ``a -> b -> c -> a`` closed by an import inside a function; ``d <-> e``
    only under ``TYPE_CHECKING`` (no cycle); ``pkg/x -> pkg`` and ``pkg -> pkg/x`` through a
    relative import and an ``import_module`` string."""
    _write(tmp_path, f"{CORE}/__init__.py", "")
    _write(tmp_path, f"{CORE}/a.py", f"from {CORE} import b\n")
    _write(tmp_path, f"{CORE}/b.py", f"import {CORE}.c as c\n")
    _write(tmp_path, f"{CORE}/c.py", f"def later():\n    from {CORE}.a import thing\n")
    _write(
        tmp_path,
        f"{CORE}/d.py",
        f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {CORE} import e\n",
    )
    _write(tmp_path, f"{CORE}/e.py", f"from {CORE}.d import X\n")
    _write(tmp_path, f"{CORE}/pkg/__init__.py", "import importlib\n")
    _write(
        tmp_path,
        f"{CORE}/pkg/x.py",
        f"from . import y\nimport importlib\nimportlib.import_module('{CORE}.pkg')\n",
    )
    _write(tmp_path, f"{CORE}/pkg/y.py", f"def f():\n    return __import__('{CORE}.pkg.x')\n")
    return tmp_path


def test_cycle_checker_finds_function_level_cycles_not_type_only_ones(cyclic_tree: Path) -> None:
    graph = import_graph(cyclic_tree)
    assert graph[f"{CORE}.d"] == {}  # type-only
    assert graph[f"{CORE}.e"] == {f"{CORE}.d": 1}
    assert import_groups(graph) == [
        [f"{CORE}.a", f"{CORE}.b", f"{CORE}.c"],
        [f"{CORE}.pkg.x", f"{CORE}.pkg.y"],
    ]
    assert import_cycles(graph) == [
        [f"{CORE}.a", f"{CORE}.b", f"{CORE}.c", f"{CORE}.a"],
        [f"{CORE}.pkg.x", f"{CORE}.pkg.y", f"{CORE}.pkg.x"],
    ]
    assert describe_cycle(import_cycles(graph)[0], graph) == (
        f"{CORE}.a (line 1) -> {CORE}.b (line 1) -> {CORE}.c (line 2) -> {CORE}.a"
    )


@pytest.fixture
def circular_distributions(tmp_path: Path) -> Path:
    """A fake core with ``a <-> b``; plugin ``alpha`` with ``x -> y -> x`` (``y`` inside a
    function) and a package that hands ``x`` out through ``__getattr__`` (a lazy attribute, no
    edge); plugin ``beta`` whose only circle is type-only, and which imports ``alpha`` back (an
    import of another distribution closes no circle inside either)."""
    _write(tmp_path, f"{CORE}/__init__.py", "")
    _write(tmp_path, f"{CORE}/a.py", f"from {CORE} import b\n")
    _write(tmp_path, f"{CORE}/b.py", f"def f():\n    import {CORE}.a\n")
    plugins = tmp_path / "plugins"
    for name in ("alpha", "beta"):
        _write(plugins, f"{name}/setup.cfg", "[metadata]\n")
    _write(
        plugins,
        "alpha/titan_alpha/__init__.py",
        "def __getattr__(name):\n    from titan_alpha import x\n    return x\n",
    )
    _write(plugins, "alpha/titan_alpha/x.py", "import titan_beta.p\nfrom titan_alpha import y\n")
    _write(plugins, "alpha/titan_alpha/y.py", "def f():\n    from . import x\n")
    _write(plugins, "alpha/tests/test_x.py", "from titan_alpha import x\n")  # not the package
    _write(plugins, "beta/titan_beta/__init__.py", "")
    _write(
        plugins,
        "beta/titan_beta/p.py",
        "from typing import TYPE_CHECKING\nimport titan_alpha.x\n"
        "if TYPE_CHECKING:\n    from titan_beta import q\n",
    )
    _write(plugins, "beta/titan_beta/q.py", "from titan_beta.p import P\n")
    return tmp_path


def test_each_distribution_is_checked_for_circles_of_its_own(circular_distributions: Path) -> None:
    modules = distribution_modules(circular_distributions)
    assert {name: sorted(found) for name, found in modules.items()} == {
        "titan-plugins (the core)": [CORE, f"{CORE}.a", f"{CORE}.b"],
        "alpha": ["titan_alpha", "titan_alpha.x", "titan_alpha.y"],
        "beta": ["titan_beta", "titan_beta.p", "titan_beta.q"],
    }
    assert module_graph(modules["alpha"])["titan_alpha"] == {}  # the lazy attribute
    assert circles(circular_distributions) == [
        f"titan-plugins (the core): 2 modules import each other in a circle: {CORE}.a, {CORE}.b"
        f"\n  e.g. {CORE}.a (line 1) -> {CORE}.b (line 2) -> {CORE}.a",
        "alpha: 2 modules import each other in a circle: titan_alpha.x, titan_alpha.y"
        "\n  e.g. titan_alpha.x (line 2) -> titan_alpha.y (line 2) -> titan_alpha.x",
    ]


# ---------------------------------------------------------------- one room per host
HOSTS_DIR = f"{CORE}/hosts"
# Rooms that read a host's own things directly: each host's room, the test harness, and the
# planner (``titan-plugins plan`` models a Megatron-LM launch: its flags, its schedule order).
HOST_READERS = (f"{CORE}/hosts/", f"{CORE}/testing/", f"{CORE}/plan/")
MEGATRON_PATH = re.compile(r"^megatron(\.\w+)+(:[\w.]+)?$")


def host_problems(root: Path) -> list[str]:
    """Where the host-neutral core (``titan_plugins`` outside :data:`HOST_READERS`) imports
    megatron, names a megatron module path, or reaches into a host's room other than through
    ``titan_plugins.hosts`` (``HOSTS``). Type-only imports (``TYPE_CHECKING``) are fine."""
    found = []
    for name, path in core_modules(root).items():
        rel = path.relative_to(root).as_posix()
        if rel.startswith(HOST_READERS):
            continue
        nodes = _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"), rel))
        for line, target in module_imports(name, path):
            if target.split(".")[0] == "megatron":
                found.append(f"{rel}:{line}: imports {target}")
            elif target.startswith(f"{CORE}.hosts.") and target != f"{CORE}.hosts.HOSTS":
                found.append(f"{rel}:{line}: reaches {target} (only titan_plugins.hosts.HOSTS)")
        for node in nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if MEGATRON_PATH.match(node.value):
                    found.append(f"{rel}:{node.lineno}: names {node.value!r}")
    return sorted(set(found))


def test_the_core_is_host_neutral_and_reaches_hosts_only_through_hosts() -> None:
    assert host_problems(ROOT) == []
    from titan_plugins import autoload, hosts
    from titan_plugins.hosts import megatron, sglang

    assert hosts.HOSTS == {"megatron": megatron, "sglang": sglang}
    # the import-torch trigger stays standard library only, so it lists the hosts' packages
    # itself: the same ones
    prefixes = {p for host in hosts.HOSTS.values() for p in host.TRIGGER_PREFIXES}
    assert set(autoload.TRIGGER_PREFIXES) == prefixes == {"megatron"}


def test_host_checker_flags_each_host_specific_line(tmp_path: Path) -> None:
    _write(tmp_path, f"{CORE}/__init__.py", "")
    _write(tmp_path, f"{HOSTS_DIR}/__init__.py", "from . import megatron\nHOSTS = {}\n")
    _write(tmp_path, f"{HOSTS_DIR}/megatron/__init__.py", "import megatron.core\n")  # its room
    _write(tmp_path, f"{HOSTS_DIR}/megatron/train_step.py", "")
    _write(tmp_path, f"{CORE}/plan/memory.py", f"from {CORE}.hosts.megatron import x\n")  # reader
    _write(
        tmp_path,
        f"{CORE}/engine.py",
        "from typing import TYPE_CHECKING\n"
        f"from {CORE}.hosts import HOSTS\n"  # the registration point: fine
        "if TYPE_CHECKING:\n"
        f"    from {CORE}.hosts.megatron.train_step import TrainStep\n"  # type only: fine
        "def f():\n"
        "    import megatron.core.parallel_state\n"  # 6
        f"    from {CORE}.hosts.megatron import train_step\n"  # 7
        "TARGET = 'megatron.core.optimizer:MixedPrecisionOptimizer.step'\n"  # 8
        "NOTE = 'megatron.core is not importable here'\n",  # prose: fine
    )
    assert host_problems(tmp_path) == [
        f"{CORE}/engine.py:6: imports megatron.core.parallel_state",
        f"{CORE}/engine.py:7: reaches {CORE}.hosts.megatron (only titan_plugins.hosts.HOSTS)",
        f"{CORE}/engine.py:7: reaches {CORE}.hosts.megatron.train_step (only "
        "titan_plugins.hosts.HOSTS)",
        f"{CORE}/engine.py:8: names 'megatron.core.optimizer:MixedPrecisionOptimizer.step'",
    ]
