"""Activation cost: while ``import megatron.core`` runs, each plugin may import only what its
registration needs (its package, plugin module, settings and patch records); everything heavy
loads when a patch is applied to a target that is used, or at first call (issue 17 item 1).

Counts modules rather than milliseconds: a timed unit test flakes with machine load, while the
set of modules a plugin imports during Megatron's import is exact (``-X importtime`` lists them).
The measured time ratio lives in ``benchmarks/activation_overhead.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from importlib import metadata

import pytest

# Modules a plugin may import while megatron.core imports, besides its package and its version
# module: the module named by its entry point, its settings, and the few holding its patch
# records and factories.
BUDGET = 5
FIRST_PARTY = {
    ep.name: ep.value.split(":")[0].split(".")[0]
    for ep in metadata.entry_points(group="titan_plugins")
    if ep.name != "example"
}


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import megatron.core"],
        env={**env, "TORCH_COMPILE_DISABLE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    by_package: dict[str, list[str]] = defaultdict(list)
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", line)
        if match:
            name = match.group(1)
            by_package[name.split(".")[0]].append(name)
    return by_package


@pytest.mark.parametrize("plugin", sorted(FIRST_PARTY))
def test_plugin_imports_little_while_megatron_loads(imported, plugin):
    modules = [m for m in imported.get(FIRST_PARTY[plugin], []) if not m.endswith(".version")]
    assert modules, f"{plugin} imported nothing: is it installed and enabled?"
    assert len(modules) <= BUDGET, f"{plugin} imported {len(modules)} modules: {modules}"


def test_the_core_loads_only_its_activation_modules(imported):
    core = set(imported.get("titan_plugins", []))
    heavy = {m for m in core if m.startswith(("titan_plugins.plan", "titan_plugins.testing"))}
    assert not heavy, f"the core imported {sorted(heavy)} during import megatron.core"
