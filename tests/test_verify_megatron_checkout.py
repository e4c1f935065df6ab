"""``titan-plugins verify --megatron-lm DIR`` judges DIR's megatron, whatever is installed: the
differential workers and the upstream-test ranks import it from the checkout and say so, and a
worker that imported another one fails loudly instead of judging the wrong Megatron."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import megatron.core
import pytest

from titan_plugins.testing.training_runs import imported_megatron
from titan_plugins.verify import differential, upstream

INSTALLED = Path(megatron.core.__file__).parent.parent
LINE = megatron.core.package_info.__version__.split("+")[0].rsplit(".", 1)[0]  # e.g. 0.19
MARKED = f"{LINE}.77"
"""The version of the marked copy: this venv's line, a patch release no wheel has."""


def marked_checkout(root: Path) -> Path:
    """A Megatron-LM checkout whose megatron is a copy of the installed one, its version
    ``MARKED``, with one upstream-style test file (the workers could only tell it from the
    installed wheel by its version and folder)."""
    checkout = root / "Megatron-LM"
    shutil.copytree(INSTALLED, checkout / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    info = checkout / "megatron" / "core" / "package_info.py"
    text = info.read_text()
    patch = re.search(r"^PATCH = (\d+)$", text, re.M)
    assert patch, "package_info.py names no PATCH"  # the copy is of the line this venv serves
    info.write_text(text[: patch.start()] + "PATCH = 77" + text[patch.end() :])
    tests = checkout / "tests" / "unit_tests"
    tests.mkdir(parents=True)
    (checkout / "tests" / "__init__.py").write_text("")
    (tests / "__init__.py").write_text("")
    (tests / "test_version.py").write_text("def test_imports():\n    import megatron.core\n")
    return checkout.resolve()


def seen_pattern(checkout: Path) -> str:
    # package_info appends "+<commit>" when its folder is inside a git work tree
    return rf"megatron-core {re.escape(MARKED)}(\+\w+)? from {re.escape(str(checkout))}"


def test_a_worker_that_imported_another_megatron_fails_naming_both(tmp_path) -> None:
    (tmp_path / "megatron").mkdir()
    with pytest.raises(RuntimeError) as err:
        imported_megatron(str(tmp_path))
    assert str(err.value) == (
        f"this worker imported {imported_megatron()}, not the megatron of the checkout "
        f"{tmp_path}: put the checkout first on the path (PYTHONPATH={tmp_path})"
    )
    assert imported_megatron(str(INSTALLED.parent)).startswith("megatron-core ")  # its own: fine


@pytest.mark.multiprocess
def test_the_differential_workers_train_the_checkout_not_the_installed_megatron(
    tmp_path,
) -> None:
    checkout = marked_checkout(tmp_path)
    result = differential.run([], ["pp2xep2"], megatron_lm=str(checkout))
    assert result.problems == [], result.problems
    assert re.fullmatch(seen_pattern(checkout), result.megatron), result.megatron


@pytest.mark.multiprocess
def test_the_upstream_ranks_import_the_checkout_and_say_so(tmp_path) -> None:
    checkout = marked_checkout(tmp_path)
    job = upstream.launch(
        checkout, ["tests/unit_tests/test_version.py"], 1, upstream.OFF,
        {"TITAN_PLUGINS": "0"}, timeout_s=600,
    )  # fmt: skip
    assert job.problem == "", job.log_tail
    assert list(job.outcomes.values()) == [upstream.Outcome("passed")]
    assert re.fullmatch(seen_pattern(checkout), job.megatron), job.megatron
