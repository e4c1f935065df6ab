"""TITAN_TRACE_DIR is checked at activation (issue 46): a file, or a folder this process can
neither create nor write, is named before training, not when the first trace is written."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from titan_trace_analysis import settings
from titan_trace_analysis.settings import DIR, dir_problem

from titan_plugins.settings import SettingError, shown_value
from titan_plugins.testing import plugin_active

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

FIX = "name a folder this process can create or write"


def _message(text: str, reason: str) -> str:
    return f"TITAN_TRACE_DIR={shown_value(text)}: {reason}; accepted: text"


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0\n")
    return path


@pytest.fixture(autouse=True)
def _lenient(monkeypatch) -> None:
    monkeypatch.delenv("TITAN_PLUGINS_STRICT", raising=False)
    monkeypatch.delenv("TITAN_TRACE_DIR", raising=False)


def test_a_file_is_named_with_the_fix(a_file: Path, monkeypatch) -> None:
    monkeypatch.setenv("TITAN_TRACE_DIR", str(a_file))
    assert DIR.problem() == _message(str(a_file), f"{a_file} exists and is not a folder: {FIX}")


def test_a_folder_below_a_file_cannot_be_created(a_file: Path, monkeypatch) -> None:
    below = a_file / "job42"
    monkeypatch.setenv("TITAN_TRACE_DIR", str(below))
    assert DIR.problem() == _message(
        str(below), f"{below} cannot be created: {a_file} is not a folder: {FIX}"
    )


def test_an_unwritable_parent_or_folder_is_named(tmp_path: Path, monkeypatch) -> None:
    # the process runs as root here, where os.access grants every write: stand in for the OS
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(settings.os, "access", lambda path, mode: path != str(locked))
    assert dir_problem(str(locked / "a" / "b")) == (
        f"{locked / 'a' / 'b'} cannot be created: {locked} is not writable by this process: {FIX}"
    )
    assert dir_problem(str(locked)) == (
        f"the folder {locked} is not writable by this process: {FIX}"
    )


def test_a_new_folder_in_a_writable_place_is_fine_and_not_made_by_the_check(
    tmp_path: Path, monkeypatch
) -> None:
    new = tmp_path / "traces" / "job42"
    monkeypatch.setenv("TITAN_TRACE_DIR", str(new))
    assert DIR.problem() is None
    assert DIR.read() == str(new)
    assert not (tmp_path / "traces").exists()  # the capture makes it at export, not activation
    assert dir_problem(str(tmp_path)) is None


def test_a_relative_path_is_judged_from_the_working_folder(a_file: Path, monkeypatch) -> None:
    monkeypatch.chdir(a_file.parent)
    assert dir_problem("passwd/traces") == (
        f"{a_file / 'traces'} cannot be created: {a_file} is not a folder: {FIX}"
    )
    assert dir_problem("traces") is None


def test_activation_stops_on_a_file_under_strict(a_file: Path) -> None:
    env = {"TITAN_TRACE_DIR": str(a_file), "TITAN_PLUGINS_STRICT": "1"}
    with pytest.raises(SettingError) as raised, plugin_active("trace_analysis", env):
        pass
    assert str(raised.value) == (
        _message(str(a_file), f"{a_file} exists and is not a folder: {FIX}")
        + " (TITAN_PLUGINS_STRICT=1: fix the value or unset it)"
    )


def test_activation_warns_on_a_file_and_uses_the_default(a_file: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        with plugin_active("trace_analysis", {"TITAN_TRACE_DIR": str(a_file)}):
            pass
    expected = _message(str(a_file), f"{a_file} exists and is not a folder: {FIX}")
    assert f"{expected} (default titan_traces used)" in caplog.messages
