"""``titan-plugins verify``'s arguments: each bad one is refused in one line (exit 2) before any
run, and a verdict that cannot be written is never reported as a failed plugin (exit 1)."""

from __future__ import annotations

import os
import shutil

import pytest

from titan_plugins.verify import cli, differential

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
