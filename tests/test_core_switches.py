"""The switch grammar (DESIGN §4) and the typed settings readers."""

from __future__ import annotations

import logging

import pytest

from titan_plugins.settings import (
    SettingError,
    env_bool,
    env_bytes,
    env_choice,
    env_float,
    env_int,
    env_list,
    parse_bytes,
)
from titan_plugins.switches import disabled_reasons, plugin_switch_var

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
    assert env_int("X_INT", 1) == 7
    assert env_float("X_FLOAT", 1.0) == 0.5
    assert env_choice("X_CHOICE", ("rdma", "tcp"), "rdma") == "tcp"
    assert env_list("X_LIST") == ("a", "b", "c")
    assert env_bytes("X_BYTES", None) == 512 << 20
    assert env_bool("X_BOOL", False) is True
    assert env_int("X_UNSET", 3) == 3


@pytest.mark.parametrize(
    ("reader", "value", "message"),
    [
        (lambda: env_int("X", 2, minimum=1), "abc", "not an integer"),
        (lambda: env_int("X", 2, minimum=1), "0", "below the minimum 1"),
        (lambda: env_float("X", 2.0), "fast", "not a number"),
        (lambda: env_choice("X", ("rdma", "tcp"), "tcp"), "udp", "not one of rdma, tcp"),
        (lambda: env_bytes("X", 5), "lots", "byte size"),
    ],
)
def test_bad_values_warn_then_raise_under_strict(monkeypatch, caplog, reader, value, message):
    monkeypatch.setenv("X", value)
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        reader()
    assert message in caplog.text
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=message):
        reader()


def test_parse_bytes_units():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("4G") == 4 << 30
    assert parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("2kb") == 2048
