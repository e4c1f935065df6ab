"""The switch grammar (DESIGN §4) and the typed settings readers."""

from __future__ import annotations

import logging
import re

import pytest

from titan_plugins.settings import BYTES, Setting, SettingError, parse_bytes
from titan_plugins.switches import disabled_reasons, plugin_switch_var

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

INSTALLED = ["fp8_blockwise", "moe_ep_overlap", "act_offload"]
SWITCH_VARS = (
    "TITAN_PLUGINS",
    "TITAN_PLUGINS_ONLY",
    "TITAN_PLUGINS_DISABLE",
    "TITAN_PLUGINS_STRICT",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (*SWITCH_VARS, *(plugin_switch_var(n) for n in INSTALLED)):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("env", "disabled"),
    [
        ({}, set()),
        ({"TITAN_PLUGINS": "0"}, set(INSTALLED)),
        ({"TITAN_PLUGINS": " off "}, set(INSTALLED)),
        ({"TITAN_PLUGINS": "1"}, set()),
        ({"TITAN_PLUGINS_ONLY": "act_offload"}, {"fp8_blockwise", "moe_ep_overlap"}),
        ({"TITAN_PLUGINS_ONLY": " act_offload , fp8_blockwise "}, {"moe_ep_overlap"}),
        ({"TITAN_PLUGINS_DISABLE": "moe_ep_overlap"}, {"moe_ep_overlap"}),
        ({"TITAN_PLUGINS_DISABLE": "*"}, set(INSTALLED)),
        ({"TITAN_FP8_BLOCKWISE": "0"}, {"fp8_blockwise"}),
        ({"TITAN_FP8_BLOCKWISE": "1"}, set()),
        ({"TITAN_PLUGINS_ONLY": "fp8_blockwise", "TITAN_FP8_BLOCKWISE": "0"}, set(INSTALLED)),
        (
            {"TITAN_PLUGINS_ONLY": "fp8_blockwise", "TITAN_PLUGINS_DISABLE": "fp8_blockwise"},
            set(INSTALLED),
        ),
    ],
)
def test_switch_matrix(monkeypatch, env, disabled):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert set(disabled_reasons(INSTALLED)) == disabled


def test_reasons_name_the_switch(monkeypatch):
    monkeypatch.setenv("TITAN_ACT_OFFLOAD", "0")
    monkeypatch.setenv("TITAN_PLUGINS_DISABLE", "moe_ep_overlap")
    reasons = disabled_reasons(INSTALLED)
    assert reasons["act_offload"] == "TITAN_ACT_OFFLOAD=0"
    assert "TITAN_PLUGINS_DISABLE" in reasons["moe_ep_overlap"]


def test_explicit_only_combines_with_env(monkeypatch):
    assert set(disabled_reasons(INSTALLED, only=["act_offload"])) == {
        "fp8_blockwise",
        "moe_ep_overlap",
    }


def test_unknown_name_lists_installed_plugins(monkeypatch, caplog):
    monkeypatch.setenv("TITAN_PLUGINS_DISABLE", "fp8_blockwize")
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        assert disabled_reasons(INSTALLED) == {}
    assert (
        "fp8_blockwize" in caplog.text
        and "act_offload, fp8_blockwise, moe_ep_overlap" in caplog.text
    )
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="installed: act_offload"):
        disabled_reasons(INSTALLED)


def test_malformed_switch_names_accepted_values(monkeypatch, caplog):
    monkeypatch.setenv("TITAN_FP8_BLOCKWISE", "maybe")
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        assert disabled_reasons(INSTALLED) == {}  # default (on) used
    assert "TITAN_FP8_BLOCKWISE='maybe'" in caplog.text and "accepted: 1 or 0" in caplog.text
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="TITAN_FP8_BLOCKWISE='maybe'"):
        disabled_reasons(INSTALLED)


def test_plugin_switch_var():
    assert plugin_switch_var("fp8_blockwise") == "TITAN_FP8_BLOCKWISE"
    assert plugin_switch_var("moe-ep.overlap") == "TITAN_MOE_EP_OVERLAP"


def test_typed_readers(monkeypatch):
    monkeypatch.setenv("X_INT", " 7 ")
    monkeypatch.setenv("X_FLOAT", "0.5")
    monkeypatch.setenv("X_CHOICE", "TCP")
    monkeypatch.setenv("X_LIST", "a, b,,c ")
    monkeypatch.setenv("X_BYTES", "512M")
    monkeypatch.setenv("X_BOOL", "yes")
    assert Setting("X_INT", int, 1, "").read() == 7
    assert Setting("X_FLOAT", float, 1.0, "").read() == 0.5
    assert Setting("X_CHOICE", str, "rdma", "", choices=("rdma", "tcp")).read() == "tcp"
    assert Setting("X_LIST", list, (), "").read() == ("a", "b", "c")
    assert Setting("X_BYTES", BYTES, None, "").read() == 512 << 20
    assert Setting("X_BOOL", bool, False, "").read() is True
    assert Setting("X_UNSET", int, 3, "").read() == 3


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        (Setting("X", int, 2, "", minimum=1), "abc", "not an integer"),
        (Setting("X", int, 2, "", minimum=1), "0", "below the minimum 1"),
        (Setting("X", float, 2.0, ""), "fast", "not a number"),
        (Setting("X", float, 2.0, ""), "nan", "not a finite number"),
        (Setting("X", float, 2.0, ""), "inf", "not a finite number"),
        (Setting("X", float, 300.0, "", maximum=86400), "1e15", "above the maximum 86400"),
        (Setting("X", str, "tcp", "", choices=("rdma", "tcp")), "udp", "not one of rdma, tcp"),
        (Setting("X", BYTES, 5, ""), "lots", "byte size"),
        (Setting("X", BYTES, 5, ""), "0.5", "not a whole number of bytes"),
        (Setting("X", list, (), "", choices=("a", "b")), "a,c", "'c' is not one of a, b"),
        (
            Setting("X", int, 1, "", validate=lambda v: "must be even" if v % 2 else None),
            "3",
            "must be even",
        ),
    ],
)
def test_bad_values_warn_then_raise_under_strict(monkeypatch, caplog, setting, value, message):
    monkeypatch.setenv("X", value)
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        assert setting.read() == setting.default
    assert message in caplog.text and f"X={value!r}" in caplog.text and "default" in caplog.text
    assert message in setting.problem()
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=message):
        setting.read()


def test_a_bad_value_warns_once_per_process(monkeypatch, caplog):
    monkeypatch.setenv("X", "abc")
    setting = Setting("X", int, 2, "")
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        for _ in range(3):
            setting.read()
    assert caplog.text.count("X='abc'") == 1


def test_accepted_and_shown_default_say_what_a_user_writes():
    assert Setting("X", BYTES, 64 << 10, "").shown_default() == "64K"
    assert Setting("X", bool, True, "").shown_default() == "1"
    assert Setting("X", float, 0.1, "", minimum=0.1, maximum=86400).accepted() == (
        "a finite number from 0.1 to 86400"
    )
    with pytest.raises(TypeError):
        Setting("X", dict, {}, "")


def test_parse_bytes_units():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("4G") == 4 << 30
    assert parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("2kb") == 2048


@pytest.mark.parametrize(
    ("var", "value", "disabled", "applied"),
    [
        (
            "TITAN_PLUGINS_ONLY",
            "act_offload,nosuch",
            {"fp8_blockwise", "moe_ep_overlap"},
            "applying TITAN_PLUGINS_ONLY=act_offload",
        ),
        ("TITAN_PLUGINS_ONLY", "nosuch", set(INSTALLED), "none is installed, so no plugin loads"),
        ("TITAN_PLUGINS_ONLY", "*", set(INSTALLED), "none is installed, so no plugin loads"),
        (
            "TITAN_PLUGINS_DISABLE",
            "moe_ep_overlap,nosuch",
            {"moe_ep_overlap"},
            "applying TITAN_PLUGINS_DISABLE=moe_ep_overlap",
        ),
        ("TITAN_PLUGINS_DISABLE", "nosuch", set(), "it disables no installed plugin"),
    ],
)
def test_an_unknown_name_warning_says_what_was_applied(
    monkeypatch, caplog, var, value, disabled, applied
):
    monkeypatch.setattr("titan_plugins.settings._WARNED", set())
    monkeypatch.setenv(var, value)
    unknown = "*" if value == "*" else "nosuch"
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        assert set(disabled_reasons(INSTALLED)) == disabled  # the behaviour the message states
    assert f"{var}={value!r}: {unknown} is not an installed plugin (installed: " in caplog.text
    assert applied in caplog.text and "default" not in caplog.text, caplog.text
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=re.escape(f"{unknown} is not an installed plugin")):
        disabled_reasons(INSTALLED)


def test_activation_with_an_unknown_only_name_loads_the_known_one_and_says_so(monkeypatch, caplog):
    from importlib import metadata

    from titan_plugins.activation import Activation
    from titan_plugins.manager import ENABLED, ENTRY_POINT_GROUP

    monkeypatch.setattr("titan_plugins.settings._WARNED", set())
    monkeypatch.setenv("TITAN_PLUGINS_ONLY", "rewind,nosuch")
    eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    state = Activation("test", entry_points=eps)
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        state.start()
    try:
        enabled = {n for n, r in state.manager.records.items() if r.state == ENABLED}
        assert enabled == {"rewind"}
        assert "nosuch is not an installed plugin" in caplog.text
        assert "(applying TITAN_PLUGINS_ONLY=rewind)" in caplog.text
        assert "the default applies" not in caplog.text
    finally:
        state.stop()
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="TITAN_PLUGINS_ONLY='rewind,nosuch': nosuch is not"):
        Activation("test", entry_points=eps).start()
