"""A plugin that ends the process at import is named (issue 46): the manager logs each plugin
before importing it (TITAN_PLUGINS_DEBUG=1), and ``titan-plugins doctor --imports`` imports
each one alone in its own process and names the one that ends it, is killed or hangs."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins import cli, manager
from titan_plugins.manager import get_plugin_manager
from titan_plugins.testing import fake_entry_point
from titan_plugins.testing.fakes import write_dist_info
from titan_plugins.testing.freshenv import clean_env

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

DIST = "titan-fake-trouble"
MODULES = {
    "good": "",
    "also_good": "VALUE = 1\n",
    "exits": "import os\nos._exit(3)\n",
    "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "hangs": "import time\ntime.sleep(120)\n",
    "raises": "raise RuntimeError('broken on purpose')\n",
}
HINT = (
    "if the process ends here, this plugin ended it "
    "(titan-plugins doctor --imports checks each plugin alone)"
)


def _install(root: Path, names: list[str]) -> None:
    """A distribution on ``root`` with one plugin per name, each module ``titan_fake_<name>``."""
    for name in names:
        (root / f"titan_fake_{name}.py").write_text(MODULES[name])
    write_dist_info(root, DIST, {name: f"titan_fake_{name}" for name in names})


@pytest.fixture
def only_these(tmp_path: Path, monkeypatch):
    """Discovery sees only the distribution under ``tmp_path`` (the installed plugins stay out)."""
    for var in [v for v in os.environ if v.startswith("TITAN_")]:
        monkeypatch.delenv(var)
    monkeypatch.syspath_prepend(str(tmp_path))  # the children import from the doctor's path
    discover = manager.discover
    monkeypatch.setattr(manager, "discover", lambda: discover(path=[str(tmp_path)]))

    def install(*names: str) -> None:
        _install(tmp_path, list(names))

    return install


def test_debug_names_the_plugin_before_an_import_that_ends_the_process(tmp_path: Path) -> None:
    _install(tmp_path, ["good", "exits"])
    env = clean_env(
        {
            "PYTHONPATH": str(tmp_path),
            "TITAN_PLUGINS_DEBUG": "1",
            "TITAN_PLUGINS_ONLY": "good,exits",
        }
    )
    done = subprocess.run(
        [sys.executable, "-c", "import titan_plugins; titan_plugins.apply()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3
    lines = [line for line in done.stderr.splitlines() if "importing plugin" in line]
    assert lines == [
        f"[titan_plugins] DEBUG importing plugin good ({DIST} 0.1, titan_fake_good); {HINT}",
        f"[titan_plugins] DEBUG importing plugin exits ({DIST} 0.1, titan_fake_exits); {HINT}",
    ]
    assert done.stderr.splitlines()[-1] == lines[-1]  # the last word of the process names it


def test_each_import_is_logged_at_debug_before_it_runs_and_a_disabled_one_never(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    (tmp_path / "titan_fake_logs.py").write_text(
        "import logging\nlogging.getLogger('titan_plugins').warning('module body runs')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TITAN_OFF", "0")
    eps = [fake_entry_point("logs", "titan_fake_logs"), fake_entry_point("off", "titan_fake_off")]
    with caplog.at_level(logging.DEBUG, logger="titan_plugins"):
        get_plugin_manager(entry_points=eps)
    seen = [m for m in caplog.messages if "importing plugin" in m or "module body" in m]
    assert seen == [
        f"importing plugin logs (fake-logs 0.0.1, titan_fake_logs); {HINT}",
        "module body runs",
    ]


def test_doctor_imports_names_the_plugins_that_end_are_killed_or_hang(only_these, capsys) -> None:
    only_these("good", "exits", "killed", "hangs", "raises")
    assert cli.main(["doctor", "--imports", "--import-timeout", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    fix = "       fix: TITAN_PLUGINS_DISABLE={} runs without it; report it to " + DIST
    assert re.fullmatch(
        rf"\[ok  \] good: import: {DIST} 0\.1, titan_fake_good: imports alone in \d+\.\d s",
        lines[0],
    )
    assert lines[1:] == [
        f"[FAIL] exits: import: {DIST} 0.1, titan_fake_exits: its import ended the process "
        "with exit status 3",
        fix.format("exits"),
        f"[FAIL] killed: import: {DIST} 0.1, titan_fake_killed: its import ended the process: "
        "killed by SIGKILL",
        fix.format("killed"),
        f"[FAIL] hangs: import: {DIST} 0.1, titan_fake_hangs: still importing after 3 s: its "
        "import hangs the process",
        fix.format("hangs"),
        f"[FAIL] raises: import: {DIST} 0.1, titan_fake_raises: raises at import (RuntimeError: "
        "broken on purpose): the manager leaves it out",
        fix.format("raises"),
        "4 of 5 plugins fail their import alone (above): exits, killed, hangs, raises; "
        "TITAN_PLUGINS_DISABLE=exits,killed,hangs,raises runs without them",
    ]


def test_doctor_imports_says_all_plugins_import(only_these, monkeypatch, capsys) -> None:
    only_these("good", "also_good", "exits")
    monkeypatch.setenv("TITAN_EXITS", "0")  # switched off: the manager never imports it
    assert cli.main(["doctor", "--imports"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["[ok  ] good", "[ok  ] also_good"]
    assert lines[2:] == [
        "all 2 plugins import, each alone in its own process (1 switched off, not imported)"
    ]


def test_doctor_imports_as_json(only_these, capsys) -> None:
    only_these("exits")
    assert cli.main(["doctor", "--imports", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == [
        {
            "plugin": "exits",
            "name": "import",
            "status": "fail",
            "detail": f"{DIST} 0.1, titan_fake_exits: its import ended the process with exit "
            "status 3",
            "fix": f"TITAN_PLUGINS_DISABLE=exits runs without it; report it to {DIST}",
        }
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--import-timeout", "5"], "--import-timeout applies to doctor --imports: add --imports"),
        (
            ["--imports", "--import-timeout", "-1"],
            "'-1' is not a positive number of seconds, e.g. 60",
        ),
        (
            ["--imports", "--import-timeout", "nan"],
            "'nan' is not a positive number of seconds, e.g. 60",
        ),
    ],
)
def test_a_bad_import_timeout_is_refused_with_the_fix(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        cli.main(["doctor", *argv])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_every_installed_plugin_imports_alone(monkeypatch) -> None:
    from titan_plugins.doctor import import_checks

    for var in [v for v in os.environ if v.startswith("TITAN_")]:
        monkeypatch.delenv(var)
    checks, summary = import_checks(timeout_s=60)
    assert set(manager.FIRST_PARTY) <= {name for name, _ in checks}
    assert [(name, c.status) for name, c in checks if c.status != "ok"] == []
    assert summary == f"all {len(checks)} plugins import, each alone in its own process"
