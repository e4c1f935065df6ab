"""Packaging rules: the trace generator (the tests' oracle) is not installed and nothing installed
imports it; no blanket lint suppression; registering the plugin imports nothing heavy."""

from __future__ import annotations

import ast
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from setuptools import find_packages

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

PLUGIN = Path(__file__).resolve().parents[1]
PACKAGE = PLUGIN / "titan_trace_analysis"
TOOLS = PLUGIN / "tools" / "gen_traces"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_nothing_installed_imports_the_generator():
    for path in PACKAGE.rglob("*.py"):
        assert "gen_traces" not in _imports(path), path
        assert "gen_traces" not in path.read_text(), path


def test_the_generator_is_not_in_the_distribution():
    cfg = configparser.ConfigParser()
    cfg.read(PLUGIN / "setup.cfg")
    include = cfg["options.packages.find"]["include"].split()
    assert find_packages(str(PLUGIN), include=include) == ["titan_trace_analysis"]
    assert not (PACKAGE / "gen_traces.py").exists()


def test_the_generator_keeps_its_own_model_and_imports_nothing_of_the_analyzer():
    for path in TOOLS.glob("*.py"):
        assert not {"titan_trace_analysis", "titan_plugins"} & _imports(path), path


def test_no_blanket_noqa():
    for path in [*PACKAGE.rglob("*.py"), *TOOLS.rglob("*.py")]:
        text = path.read_text()
        assert not re.search(r"#\s*ruff:\s*noqa", text), path
        assert not re.search(r"#\s*noqa(?!:)", text), path  # a bare noqa silences everything


def test_registration_imports_nothing_heavy():
    code = (
        "import sys, json; import titan_plugins; before = set(sys.modules);"
        "import titan_trace_analysis.plugin;"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    added = json.loads(out.stdout)
    assert not [m for m in added if m.split(".")[0] in ("torch", "megatron", "orjson", "isal")]
    assert {m for m in added if m.startswith("titan_trace_analysis")} == {
        "titan_trace_analysis",
        "titan_trace_analysis.capture",
        "titan_trace_analysis.plugin",
        "titan_trace_analysis.settings",
        "titan_trace_analysis.version",
    }
