"""``titan-plugins verify``'s arguments: each bad one is refused in one line (exit 2) before any
run, and a verdict that cannot be written is never reported as a failed plugin (exit 1)."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from titan_plugins.verify import cli, conftest_needs, differential

pytestmark = pytest.mark.line_independent


@pytest.fixture
def no_run(monkeypatch) -> list:
    """``differential.run`` replaced: the calls it got (none when the arguments are refused)."""
    calls: list = []

    def passed(*args, **kwargs):
        calls.append((args, kwargs))
        return differential.DifferentialResult({}, {}, [], 1.0)

    monkeypatch.setattr(differential, "run", passed)
    return calls


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--budget-min", "-5"],
            "--budget-min: -5 is not a number of minutes above 0 (e.g. --budget-min 20)",
        ),
        (
            ["--budget-min", "nan"],
            "--budget-min: nan is not a number of minutes above 0 (e.g. --budget-min 20)",
        ),
        (
            ["--budget-min", "0"],
            "--budget-min: 0 is not a number of minutes above 0 (e.g. --budget-min 20)",
        ),
        (
            ["--timeout-min", "inf"],
            "--timeout-min: inf is not a number of minutes above 0 (e.g. --timeout-min 20)",
        ),
        (
            ["--timeout-min", "-1"],
            "--timeout-min: -1 is not a number of minutes above 0 (e.g. --timeout-min 20)",
        ),
        (
            ["--world-sizes", "3"],
            "--world-sizes chooses the ranks of Megatron-LM's unit tests, which run only with a "
            "checkout: add --megatron-lm DIR, or leave --world-sizes out",
        ),
    ],
)
def test_a_bad_number_or_an_unused_flag_is_refused_before_any_run(
    argv, message, no_run, capsys
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"titan-plugins verify: {message}\n"
    assert no_run == []


def test_a_json_file_that_cannot_be_written_is_refused_before_any_run(
    tmp_path, no_run, capsys
) -> None:
    missing = tmp_path / "nonexistent" / "v.json"
    assert cli.main(["--json", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"titan-plugins verify: --json {missing}: no folder {missing.parent}; create it first "
        "or name another\n"
    )
    assert cli.main(["--json", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"titan-plugins verify: --json {tmp_path}: is a folder; name a file in it, e.g. "
        f"{tmp_path / 'v.json'}\n"
    )
    if os.geteuid() != 0:  # root writes a read-only folder: nothing to refuse there
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert cli.main(["--json", str(locked / "v.json")]) == 2
        assert "not writable by this user" in capsys.readouterr().err
    assert no_run == []
    assert cli.main(["--json", str(tmp_path / "v.json")]) == 0  # a good one runs
    assert len(no_run) == 1 and (tmp_path / "v.json").is_file()


def test_a_verdict_that_cannot_be_written_after_a_pass_is_not_a_failed_plugin(
    tmp_path, monkeypatch, capsys
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()

    def passes_and_the_folder_goes(*args, **kwargs):
        shutil.rmtree(folder)  # writable when checked, gone when written
        return differential.DifferentialResult({}, {}, [], 1.0)

    monkeypatch.setattr(differential, "run", passes_and_the_folder_goes)
    status = cli.main(["--json", str(folder / "v.json")])
    out, err = capsys.readouterr()
    assert "verdict: PASS" in out
    assert status == cli.NOT_WRITTEN == 4
    assert err == (
        f"titan-plugins verify: the verdict above was not written to --json {folder / 'v.json'}: "
        "No such file or directory; run again with a file you can write\n"
    )


def test_a_checkout_of_a_line_the_plugins_do_not_serve_is_refused_in_one_line(
    tmp_path, no_run, capsys
) -> None:
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text('MAJOR = 0\nMINOR = 99\nPATCH = 0\nPRE_RELEASE = ""\n')
    assert cli.main(["--megatron-lm", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"titan-plugins verify: {tmp_path}: megatron-core 0.99.0 is outside the lines the "
        "plugins serve (0.16, 0.17, 0.18, 0.19); check out one of them, e.g. core_v0.19.0\n"
    )
    assert no_run == []


def _checkout_with_conftest(root: Path) -> Path:
    """A 0.19 checkout whose conftest chain imports two modules that exist nowhere (one through
    a helper of the checkout, one by a relative import), and some that do not count."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text('MAJOR = 0\nMINOR = 19\nPATCH = 0\nPRE_RELEASE = ""\n')
    tests = root / "tests" / "unit_tests"
    tests.mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text(
        "import os\nimport pytest\n"
        "from tests.unit_tests.helpers import ready\n"
        "from . import sibling\n"
        "try:\n    import titan_optional_guarded\nexcept ImportError:\n    pass\n"
        "def fixture():\n    import titan_only_when_called\n"
    )
    (tests / "helpers.py").write_text("import titan_no_such_module_b\nready = True\n")
    (tests / "sibling.py").write_text("import yaml as _y\nimport titan_no_such_module_a\n")
    return root


def test_a_conftest_import_missing_here_is_named_in_seconds_before_any_job(
    tmp_path, no_run, capsys
) -> None:
    checkout = _checkout_with_conftest(tmp_path)
    started = time.monotonic()
    assert cli.main(["--megatron-lm", str(checkout)]) == 2
    assert time.monotonic() - started < 30  # no job started (the probe's took 8 minutes)
    conftest = checkout / "tests" / "unit_tests" / "conftest.py"
    assert capsys.readouterr().err == (
        f"titan-plugins verify: {conftest} imports titan_no_such_module_a, "
        "titan_no_such_module_b, not importable here: pip install 'titan-plugins[verify]' (or "
        "pip install titan_no_such_module_a titan_no_such_module_b)\n"
    )
    assert no_run == []
    # guarded (try), function-level and standard-library imports are not needs; the chain is
    # followed through the checkout's own modules, relative imports included
    assert conftest_needs.third_party(checkout) == {
        "pytest": "tests/unit_tests/conftest.py",
        "yaml": "tests/unit_tests/sibling.py",
        "titan_no_such_module_a": "tests/unit_tests/sibling.py",
        "titan_no_such_module_b": "tests/unit_tests/helpers.py",
    }
    assert conftest_needs.pip_command(["click", "yaml"]) == "pip install click pyyaml"


def test_the_verify_extra_holds_what_the_served_lines_conftests_import() -> None:
    # measured with conftest_needs.third_party on core_v0.16.1 and core_v0.19.0 (git archive of
    # the tags): beyond torch, numpy, packaging and typing_extensions (megatron-core's own
    # dependencies) they import click and requests (tests/test_utils' dataset download),
    # triton (0.16.1: batch_invariant_kernels; 0.19.0: moe/ops/paged_stash), and 0.16.1 also
    # yaml, six, regex and pydantic (megatron.training, megatron.rl)
    config = configparser.ConfigParser()
    config.read(Path(__file__).parents[1] / "setup.cfg")
    extra = [line for line in config["options.extras_require"]["verify"].splitlines() if line]
    names = {re.split(r"[=;<> ]", line)[0].lower() for line in extra}
    assert {"click", "requests", "pyyaml", "triton", "six", "regex", "pydantic"} <= names
    assert all("==" in line for line in extra), extra  # pinned
    assert 'triton==3.7.1; platform_system == "Linux"' in extra  # the pin of torch 2.13's own
