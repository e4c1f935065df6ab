"""What a Megatron-LM checkout's unit-test ``conftest.py`` needs importable, found without
running it: the third-party modules its import chain imports (``titan-plugins verify`` checks
them once, before it starts a job, instead of every rank of every job failing on the first).

The chain is read with :mod:`ast`: the conftest's imports, and the imports of each module of the
checkout they reach (``tests.*``, ``megatron.*``), transitively. Only imports that run when a
module is imported count: those at a module's top level, outside ``try`` (megatron guards its
optional dependencies so: Transformer Engine, apex), ``if`` and function bodies.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import warnings
from pathlib import Path

CONFTEST = "tests/unit_tests/conftest.py"
DISTRIBUTIONS = {"yaml": "pyyaml"}
"""Modules whose distribution (the ``pip install`` name) is not the module's name."""


def _ours(checkout: Path, top: str) -> bool:
    """Whether the top-level module ``top`` is the checkout's own (a folder or a file in it)."""
    return (checkout / top).is_dir() or (checkout / f"{top}.py").is_file()


def _local(checkout: Path, dotted: str) -> list[Path]:
    """The checkout's files that ``import dotted`` runs (each package's ``__init__`` on the way,
    then the module); empty when its top-level package is not in the checkout."""
    parts = dotted.split(".")
    if not _ours(checkout, parts[0]):
        return []
    files = []
    for depth in range(1, len(parts) + 1):
        base = checkout.joinpath(*parts[:depth])
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                files.append(candidate)
                break
    return files


def _imported(tree: ast.Module, package: str) -> list[str]:
    """The dotted names a module's top-level imports name (``from a import b``: ``a`` and
    ``a.b``, which may be a submodule); relative ones resolved against ``package``."""
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            if base:
                names.append(base)
                names += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return names


def third_party(checkout: Path, start: str = CONFTEST) -> dict[str, str]:
    """Top-level module -> the checkout file (relative) that first imports it, over the import
    chain of ``start``; neither the standard library nor the checkout's own packages."""
    found: dict[str, str] = {}
    todo, seen = [checkout / start], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            with warnings.catch_warnings():  # its invalid escapes in docstrings are not ours
                warnings.simplefilter("ignore", SyntaxWarning)
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        except (OSError, SyntaxError, ValueError):
            continue  # pytest names a file that does not parse; nothing to find here
        relative = path.relative_to(checkout)
        module = ".".join(relative.with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        package = package.removesuffix(".__init__")
        for dotted in _imported(tree, package):
            top = dotted.split(".")[0]
            if _ours(checkout, top):
                todo += _local(checkout, dotted)
            elif top not in sys.stdlib_module_names:
                found.setdefault(top, relative.as_posix())
    return found


def missing(checkout: Path, start: str = CONFTEST) -> dict[str, str]:
    """The modules of :func:`third_party` that this environment cannot import (not imported:
    found by ``importlib.util.find_spec``), each with the file that imports it."""
    return {
        name: where
        for name, where in sorted(third_party(checkout, start).items())
        if importlib.util.find_spec(name) is None
    }


def pip_command(modules: list[str]) -> str:
    """``pip install`` of the distributions that ship ``modules``."""
    return "pip install " + " ".join(DISTRIBUTIONS.get(m, m) for m in modules)
