"""Any value a knob's reader cannot turn into a finite number of the right type is that knob's
own named problem: a warning naming the variable (the default applies), an error under STRICT,
never an exception that fails the whole activation (issue 29)."""

from __future__ import annotations

import logging
import math
import os
from importlib import metadata

import pytest

from titan_plugins import activation, report, settings
from titan_plugins.activation import Activation
from titan_plugins.manager import BUILTIN, ENABLED, ENTRY_POINT_GROUP, get_plugin_manager
from titan_plugins.settings import BYTES, Setting, SettingError
from titan_plugins.switches import CORE_SETTINGS

HUGE = "9" * 401  # parse_bytes made it float inf, and int(inf) raised OverflowError
BYTE_KNOBS = (
    "TITAN_PLUGINS_MAX_HOST_BYTES",
    "TITAN_REWIND_MAX_HOST_BYTES",
    "TITAN_PP_RDMA_INLINE_BYTES",
    "TITAN_ACT_OFFLOAD_MIN_BYTES",
    "TITAN_ACT_OFFLOAD_MAX_HOST_BYTES",
)
INT64_MAX = (1 << 63) - 1
NASTY = [
    HUGE,
    "-" + HUGE,
    HUGE + "K",
    "9" * 5000,  # past Python's 4300-digit int conversion limit
    "0." + "0" * 5000 + "1",
    "1" + "0" * 30 + "T",
    "99999999999999999999T",
    "9223372036854775808",
    "-9223372036854775809",
    "8E",
    "1e999",
    "-1e999",
    "1e308",
    "1e-400",
    "1e400K",
    "nan",
    "NaN",
    "-nan",
    "inf",
    "-inf",
    "Infinity",
    "0x10",
    "1_000",
    "\uff11\uff12",  # fullwidth digits
    "\u00b2",  # superscript two: isdigit() but not int()
    "\udcff",  # an undecodable byte, as os.environ holds it
    "K",
    ".",
    "1..2",
    "-0",
    "-1",
    "0",
    "1.5",
    ",".join(["x"] * 2000),
]


def _installed_eps() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def declared_settings() -> list[Setting]:
    """The core's settings and every installed plugin's, switched on or off."""
    found = list(CORE_SETTINGS)
    pm = get_plugin_manager(switches=False)
    for impl in pm.hook.titan_settings.get_hookimpls():
        if impl.plugin_name != BUILTIN:
            found.extend(impl.function() or [])
    return found


SYNTHETIC = [
    Setting("TITAN_T_BOOL", bool, True, ""),
    Setting("TITAN_T_INT", int, 3, "", minimum=1),
    Setting("TITAN_T_INT_RANGE", int, 3, "", minimum=-5, maximum=5),
    Setting("TITAN_T_FLOAT", float, 0.5, "", minimum=0.0, maximum=1e300),
    Setting("TITAN_T_STR", str, "a", "", choices=("a", "b")),
    Setting("TITAN_T_LIST", list, (), "", choices=("x", "y")),
    Setting("TITAN_T_BYTES", BYTES, None, ""),
    Setting("TITAN_T_BYTES_MIN", BYTES, 4096, "", minimum=1),
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("TITAN_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr(settings, "_WARNED", set())  # each test sees its own warnings
    monkeypatch.setattr(activation, "_CURRENT", None)
    yield
    activation.undo()


def _check_value(setting: Setting, value: str, monkeypatch) -> None:
    monkeypatch.setenv(setting.name, value)
    message = setting.problem()  # never raises
    got = setting.read()  # never raises without STRICT
    if message is not None:
        assert message.startswith(f"{setting.name}="), message
        assert "accepted:" in message and len(message) < 1200, message[:300]
        assert got == setting.default
    elif setting.type in (int, BYTES) and got is not None:
        assert isinstance(got, int) and abs(got) <= INT64_MAX, (setting.name, value)
    elif setting.type is float and got is not None:
        assert isinstance(got, float) and math.isfinite(got), (setting.name, value)
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    try:
        strict_got = setting.read()
    except SettingError as err:
        assert message is not None and setting.name in str(err)
    else:
        assert message is None and strict_got == got
    monkeypatch.delenv("TITAN_PLUGINS_STRICT")


@pytest.mark.parametrize("value", NASTY, ids=range(len(NASTY)))
def test_nasty_values_over_every_declared_knob_are_a_named_problem_or_a_finite_value(
    monkeypatch, value
):
    everything = declared_settings() + SYNTHETIC
    assert {s.type for s in everything} == {bool, int, float, str, list, BYTES}
    assert set(BYTE_KNOBS) <= {s.name for s in everything}
    for setting in everything:
        if setting.name == "TITAN_PLUGINS_STRICT":
            continue  # any set value of it is strict; covered in test_core_strict
        _check_value(setting, value, monkeypatch)
        monkeypatch.delenv(setting.name)


@pytest.mark.parametrize(
    ("setting", "value", "words"),
    [
        (Setting("X_B", BYTES, None, ""), HUGE, "too large"),
        (Setting("X_B", BYTES, None, ""), "9" * 5000, "too large"),
        (Setting("X_B", BYTES, None, ""), "8E", "byte size"),
        (Setting("X_B", BYTES, None, ""), "8192P", "byte size"),
        (Setting("X_B", BYTES, None, ""), "9999999999T", "too large"),
        (Setting("X_I", int, 1, ""), HUGE, "too large"),
        (Setting("X_I", int, 1, ""), "9" * 5000, "too large"),
        (Setting("X_I", int, 1, ""), "-9223372036854775809", "too large"),
        (Setting("X_F", float, 1.0, ""), HUGE, "not a finite number"),
        (Setting("X_F", float, 1.0, ""), "1e999", "not a finite number"),
    ],
    ids=lambda v: v.name if isinstance(v, Setting) else (v if len(v) < 20 else f"{len(v)}chars"),
)
def test_overflowing_values_say_why(monkeypatch, setting, value, words):
    monkeypatch.setenv(setting.name, value)
    message = setting.problem()
    assert message is not None and words in message
    if len(value) > 100:  # the value is shortened, with its length
        assert f"({len(value)} characters)" in message and value not in message


def test_a_validator_that_raises_is_the_knobs_problem_not_an_exception(monkeypatch, caplog):
    def broken(value):
        raise TypeError("plugin bug")

    setting = Setting("X_V", int, 2, "", validate=broken)
    monkeypatch.setenv("X_V", "5")
    assert "X_V='5'" in setting.problem() and "TypeError: plugin bug" in setting.problem()
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        assert setting.read() == 2
    assert "X_V='5'" in caplog.text and "default 2 used" in caplog.text
    assert settings.problems([setting, object()])  # a non-Setting is reported, not raised


@pytest.mark.parametrize("knob", BYTE_KNOBS)
def test_a_huge_byte_size_is_that_knobs_problem_and_every_plugin_still_loads(
    monkeypatch, caplog, knob
):
    monkeypatch.setenv(knob, HUGE)
    state = Activation("test", entry_points=_installed_eps())
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        state.start()
    try:
        assert state.state == activation.ACTIVE, state.detail
        records = state.manager.records
        assert records and all(r.state == ENABLED for r in records.values()), records
        (problem,) = state.problems
        assert problem.startswith(f"{knob}='9999") and "(401 characters)" in problem
        assert "too large" in problem and "accepted: a byte size" in problem
        assert "OverflowError" not in caplog.text and "activation failed" not in caplog.text
        assert caplog.text.count(f"{knob}=") == 1 and "used" in caplog.text
        data = report.collect(state)  # raised OverflowError when the core's knob was huge
        assert data["problems"] == [problem] and data["host_memory"]["limit"] > 0
        (declared,) = [s for s in declared_settings() if s.name == knob]
        assert declared.read() == declared.default
    finally:
        state.stop()


@pytest.mark.parametrize("knob", BYTE_KNOBS)
def test_under_strict_a_huge_byte_size_raises_its_setting_error(monkeypatch, knob):
    monkeypatch.setenv(knob, HUGE)
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    state = Activation("test", entry_points=_installed_eps())
    with pytest.raises(SettingError, match=f"{knob}='9999.*too large"):
        state.start()
    assert state.engine is None and not state.is_active
