"""The ``TITAN_*`` namespace is checked at activation (issue 46, item 2): a variable that neither
the core nor an installed plugin declares is a named problem with the closest declared name (a
SettingError under STRICT); a switched-off plugin's knob is no typo, and its plugin module is not
imported to find out. STRICT's own bad value and empty switch-list entries (item 12) are named as
what they are."""

from __future__ import annotations

import importlib
import os
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from titan_plugins import activation, namespace, settings, switches
from titan_plugins.activation import Activation
from titan_plugins.manager import ENTRY_POINT_GROUP, FIRST_PARTY
from titan_plugins.settings import SettingError
from titan_plugins.switches import CORE_SETTINGS, plugin_switch_var
from titan_plugins.testing import fake_entry_point, fake_module

pytestmark = pytest.mark.line_independent

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "is set but no installed plugin declares it, nor the core: "


@pytest.fixture
def clean(monkeypatch):
    """No TITAN_* variable of the caller, warnings not yet given, no process activation."""
    for var in [v for v in os.environ if v.startswith("TITAN_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr(settings, "_WARNED", set())
    monkeypatch.setattr(activation, "_CURRENT", None)
    return monkeypatch


def _installed() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _problems(monkeypatch: pytest.MonkeyPatch, **env: str) -> list[str]:
    """The problems of a lenient activation of every installed plugin under ``env``."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    state = Activation("test", entry_points=_installed(), strict=False)
    try:
        state.start()
        return list(state.problems)
    finally:
        state.stop()


def test_unknown_variables_name_the_closest_declared_name():
    env = {
        "TITAN_FP8_BLOCKWIS": "0",
        "TITAN_PLUGIN": "0",
        "TITAN_PLUGINS_DISABLED": "fp8_blockwise",
        "TITAN_ZZZ_QQQ": "1",
        "TITAN_RUN": "1",  # titan-run's own mark: declared by the core
        "TITAN_FP8_BLOCKWISE": "1",
        "NOT_TITAN_X": "1",
    }
    assert namespace.unknown_variables({"TITAN_FP8_BLOCKWISE"}, env) == [
        f"TITAN_FP8_BLOCKWIS {UNKNOWN}did you mean TITAN_FP8_BLOCKWISE? (or unset it)",
        f"TITAN_PLUGIN {UNKNOWN}did you mean TITAN_PLUGINS? (or unset it)",
        f"TITAN_PLUGINS_DISABLED {UNKNOWN}did you mean TITAN_PLUGINS_DISABLE? (or unset it)",
        f"TITAN_ZZZ_QQQ {UNKNOWN}a typo? unset it",
    ]
    assert namespace.unknown_variables((), {"TITAN_ZZZ_QQQ": "1"}, ("TITAN_ZZZ_",)) == []


@pytest.mark.parametrize(
    ("var", "closest"),
    [
        ("TITAN_FP8_BLOCKWIS", "TITAN_FP8_BLOCKWISE"),
        ("TITAN_PLUGIN", "TITAN_PLUGINS"),
        ("TITAN_PLUGINS_DISABLED", "TITAN_PLUGINS_DISABLE"),
        ("TITAN_REWIND_INTERVL", "TITAN_REWIND_INTERVAL"),
    ],
)
def test_a_misspelled_variable_is_a_problem_at_activation_and_an_error_under_strict(
    clean, var, closest
):
    message = f"{var} {UNKNOWN}did you mean {closest}? (or unset it)"
    assert _problems(clean, **{var: "0"}) == [message]
    clean.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError) as raised:
        Activation("test", entry_points=_installed()).start()
    assert str(raised.value) == message + settings.STRICT_SUFFIX


def test_a_switched_off_plugins_knobs_are_declared_without_importing_its_plugin(clean):
    # trace_analysis and weight_sync off: their knobs (TITAN_TRACE_*, TITAN_SGLANG_PYTHON) do
    # not start with their switch's name, so only their settings modules can vouch for them
    for module in ("titan_trace_analysis.plugin", "titan_weight_sync.plugin"):
        clean.delitem(sys.modules, module, raising=False)
    env = {
        "TITAN_PLUGINS_DISABLE": "trace_analysis,weight_sync",
        "TITAN_TRACE_STEPS": "3",
        "TITAN_SGLANG_PYTHON": "/usr/bin/python3",
        "TITAN_TRACE_STEPZ": "3",
    }
    closest = "did you mean TITAN_TRACE_STEPS? (or unset it)"
    assert _problems(clean, **env) == [f"TITAN_TRACE_STEPZ {UNKNOWN}{closest}"]
    assert "titan_trace_analysis.plugin" not in sys.modules
    assert "titan_weight_sync.plugin" not in sys.modules


def test_a_plugin_left_out_of_the_activation_still_declares_its_knobs(clean):
    # an activation of one plugin (as plugin_active makes): the other installed ones declare too
    clean.setenv("TITAN_REWIND_INTERVAL", "5")
    eps = [ep for ep in _installed() if ep.name == "fp8_blockwise"]
    state = Activation("test", entry_points=eps, strict=True)
    try:
        assert state.start().problems == []
    finally:
        state.stop()


def test_a_plugin_without_a_settings_module_owns_its_prefix(clean):
    # a third-party plugin whose knobs cannot be listed without importing it: switched off, its
    # whole TITAN_<NAME>_ namespace is its own, and a misspelled prefix is still caught
    fake_module("titan_zz_fake_plugin")
    ep = fake_entry_point("zz_fake", "titan_zz_fake_plugin")
    clean.setattr("titan_plugins.manager.discover", lambda: [ep])
    env = {"TITAN_ZZ_FAKE": "0", "TITAN_ZZ_FAKE_ANY_KNOB": "1", "TITAN_ZZ_FAKX_KNOB": "1"}
    assert _problems(clean, **env) == [
        f"TITAN_ZZ_FAKX_KNOB {UNKNOWN}did you mean TITAN_ZZ_FAKE? (or unset it)"
    ]


def test_the_usual_case_reads_no_declaration(clean):
    # the check runs inside every ``import megatron``: with only the core's names set, it must
    # not ask any plugin (nor discover the installed ones again)
    class NoManager:
        records = property(lambda self: pytest.fail("the records were read"))

    clean.setenv("TITAN_PLUGINS_STRICT", "0")
    clean.setenv("TITAN_RUN", "1")
    assert namespace.activation_problems(NoManager()) == []


def test_every_titan_name_the_tree_reads_is_declared():
    # the launcher, demo, verify, test harness and launch scripts set or read these in processes
    # that import megatron: a user running the README's commands must never see "unknown"
    declared = {s.name for s in CORE_SETTINGS} | set(namespace.OTHER_NAMES)
    for name, dist in FIRST_PARTY.items():
        declared.add(plugin_switch_var(name))
        module = importlib.import_module(dist.replace("-", "_") + ".settings")
        declared.update(s.name for s in module.SETTINGS)
    files = [*ROOT.glob("entrypoints/**/*.py"), *ROOT.glob("entrypoints/*.sh")]
    files += [*ROOT.glob("scripts/*.sh"), ROOT / "README.md"]  # new_plugin.py: examples only
    files += [p for p in ROOT.glob("titan_plugins/**/*.py") if "plan" not in p.parts]
    used = {
        (name, path.relative_to(ROOT).as_posix())
        for path in files
        for name in re.findall(r"(?<![A-Za-z0-9_<])TITAN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    assert len(used) > 20  # the scan sees the tree
    assert sorted((n, p) for n, p in used if n not in declared) == []


def test_strict_s_own_bad_value_is_named_as_what_it_is(clean):
    clean.setenv("TITAN_PLUGINS_STRICT", "garbage")
    with pytest.raises(SettingError) as raised:
        Activation("test", entry_points=[]).start()
    assert str(raised.value) == (
        "TITAN_PLUGINS_STRICT='garbage' is not a boolean (accepted: 1/true/yes/on or "
        "0/false/no/off) (an unreadable TITAN_PLUGINS_STRICT counts as on: fix the values or "
        "unset them)"
    )
    assert "TITAN_PLUGINS_STRICT=1" not in str(raised.value)


@pytest.mark.parametrize(
    ("var", "value", "message", "applied"),
    [
        (
            "TITAN_PLUGINS_ONLY",
            ",,,",
            "TITAN_PLUGINS_ONLY=',,,': 4 empty entries (stray commas?): remove them",
            "treated as unset",
        ),
        (
            "TITAN_PLUGINS_DISABLE",
            "rewind,,",
            "TITAN_PLUGINS_DISABLE='rewind,,': 2 empty entries (stray commas?): remove them",
            "applying TITAN_PLUGINS_DISABLE=rewind",
        ),
        (
            "TITAN_PLUGINS_PICK",
            ",",
            "TITAN_PLUGINS_PICK=',': 2 empty entries (stray commas?): remove them",
            "treated as unset",
        ),
        (
            "TITAN_PLUGINS_PICK",
            "rewind=",
            "TITAN_PLUGINS_PICK='rewind=': 'rewind=' is not name=distribution "
            "(e.g. my_plugin=my-dist); accepted: a comma-separated list",
            "default (empty) used",
        ),
        (
            "TITAN_PLUGINS_PICK",
            "=x",
            "TITAN_PLUGINS_PICK='=x': '=x' is not name=distribution (e.g. my_plugin=my-dist); "
            "accepted: a comma-separated list",
            "default (empty) used",
        ),
    ],
)
def test_empty_switch_entries_are_named_problems(clean, var, value, message, applied):
    assert _problems(clean, **{var: value}) == [message]
    (problem,) = switches.core_problems()
    assert problem.fallback == applied
    clean.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=re.escape(message)):
        Activation("test", entry_points=[]).start()


def test_a_refused_pick_with_a_stray_comma_says_the_default_applies(clean):
    clean.setenv("TITAN_PLUGINS_PICK", "rewind=,")
    assert [(p, p.fallback) for p in switches.core_problems()] == [
        (
            "TITAN_PLUGINS_PICK='rewind=,': 'rewind=' is not name=distribution "
            "(e.g. my_plugin=my-dist); accepted: a comma-separated list",
            "default (empty) used",
        ),
        (
            "TITAN_PLUGINS_PICK='rewind=,': an empty entry (a stray comma?): remove it",
            "default (empty) used",  # not "applying rewind=": PICK is refused as a whole
        ),
    ]


def test_an_allowlist_of_stray_commas_loads_every_plugin_as_its_warning_says(clean):
    clean.setenv("TITAN_PLUGINS_ONLY", ",,,")
    state = Activation("test", entry_points=_installed(), strict=False)
    try:
        state.start()
        assert {r.state for r in state.manager.records.values()} == {"enabled"}
    finally:
        state.stop()
