"""The ``line_independent`` guard (``titan_plugins.testing.line_guard``): a marked test that
reaches megatron, in its own process or in a process it starts, fails with a message naming the
marker; an honest one passes and leaves megatron as it found it.

The cases run in one inner pytest session (the root conftest's plugin, a folder of its own); the
inner tests import only the ``megatron`` namespace package, which costs milliseconds.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = """
import os
import subprocess
import sys

import pytest

import titan_plugins.testing.line_guard as line_guard

independent = pytest.mark.line_independent


@independent
def test_honest():
    assert "megatron" not in sys.modules  # hidden, though the session imported it


@independent
def test_imports_megatron():
    import megatron  # noqa: F401


@independent
def test_catches_the_refusal():
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pass


@independent
def test_starts_a_megatron_process():
    subprocess.run([sys.executable, "-c", "import megatron"], check=True)


@independent
def test_starts_a_megatron_process_with_its_own_pythonpath_and_no_titan_variables():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    env["PYTHONPATH"] = "/nonexistent"
    subprocess.run([sys.executable, "-c", "import megatron"], check=True, env=env)


@independent
def test_starts_a_plain_process():
    subprocess.run([sys.executable, "-c", "import json"], check=True)


def test_unmarked_starts_a_pool(pool):
    pool.run(line_guard.child_records, line_guard.PROBE_DIR)  # its workers imported megatron


@independent
def test_runs_a_task_on_a_pool_started_before(pool):
    pool.run(line_guard.child_records, line_guard.PROBE_DIR)


@pytest.fixture(scope="module")
def pool():
    from titan_plugins.testing.workers import GlooWorkerPool

    with GlooWorkerPool(1) as workers:
        yield workers


def test_unmarked_imports_megatron():
    import megatron

    sys.modules["titan_inner_megatron"] = megatron


@independent
def test_unmarked_import_is_hidden_then_back():
    assert "megatron" not in sys.modules


def test_megatron_is_back_after_marked_tests():
    assert sys.modules["megatron"] is sys.modules["titan_inner_megatron"]
"""

TOP_IMPORT = """
import megatron  # noqa: F401
import pytest


@pytest.mark.line_independent
def test_in_a_module_that_imports_megatron():
    pass
"""


def _outcomes(junit: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        text = "".join(
            (node.get("message") or "") + (node.text or "")
            for node in (case.find("failure"), case.find("error"))
            if node is not None
        )
        outcomes[case.get("name")] = text if failed else "passed"
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("inner")
    (folder / "test_cases.py").write_text(CASES)
    (folder / "test_top_import.py").write_text(TOP_IMPORT)
    (folder / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    junit = folder / "junit.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "titan_plugins.testing.pytest_plugin",
         f"--junitxml={junit}", "-o", "junit_family=xunit2", str(folder)],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert junit.exists(), done.stdout + done.stderr
    return _outcomes(junit)


def test_an_honest_marked_test_passes(outcomes: dict[str, str]) -> None:
    assert outcomes["test_honest"] == "passed"
    assert outcomes["test_starts_a_plain_process"] == "passed"
    assert outcomes["test_unmarked_imports_megatron"] == "passed"
    assert outcomes["test_unmarked_starts_a_pool"] == "passed"


def test_a_marked_test_that_imports_megatron_fails_naming_the_marker(
    outcomes: dict[str, str],
) -> None:
    for name in ("test_imports_megatron", "test_catches_the_refusal"):
        assert "is marked line_independent, but it reached megatron" in outcomes[name]
        assert "remove the line_independent marker" in outcomes[name]


def test_a_marked_test_whose_child_imports_megatron_fails_naming_the_command(
    outcomes: dict[str, str],
) -> None:
    for name in (
        "test_starts_a_megatron_process",
        # the venv's .pth still runs the probe; the tests' TITAN_*-free environments keep it
        "test_starts_a_megatron_process_with_its_own_pythonpath_and_no_titan_variables",
    ):
        says = outcomes[name]
        assert "it started processes that imported megatron" in says
        assert f"{sys.executable} -c" in says  # the record's command (-c hides its code)


def test_a_marked_test_using_a_worker_that_imported_megatron_before_fails(
    outcomes: dict[str, str],
) -> None:
    says = outcomes["test_runs_a_task_on_a_pool_started_before"]
    assert "it reached a gloo worker task (child_records)" in says


def test_a_marked_test_in_a_module_importing_megatron_fails(outcomes: dict[str, str]) -> None:
    says = outcomes["test_in_a_module_that_imports_megatron"]
    assert "its module imports megatron at its top" in says


def test_megatron_is_hidden_during_and_restored_after(outcomes: dict[str, str]) -> None:
    assert outcomes["test_unmarked_import_is_hidden_then_back"] == "passed"
    assert outcomes["test_megatron_is_back_after_marked_tests"] == "passed"
