"""Discovery with fake distributions: blocking before load, failures isolated, unknown hooks."""

from __future__ import annotations

import pytest

from titan_plugins import hookimpl
from titan_plugins.manager import DISABLED, ENABLED, FAILED, get_plugin_manager
from titan_plugins.patching import Patch
from titan_plugins.testing import fake_entry_point, fake_module


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    """Three in-memory plugins: a good one, one that raises at import, one with an unknown hook."""
    for var in ("TITAN_PLUGINS", "TITAN_PLUGINS_ONLY", "TITAN_PLUGINS_DISABLE", "TITAN_GOOD"):
        monkeypatch.delenv(var, raising=False)

    @hookimpl
    def titan_register_patches(register):
        register(
            Patch(
                id="good.p",
                target="titan_fake_target:f",
                replace=lambda o: o,
                rationale="test",
                remove_when="test",
                optional=True,
            )
        )

    @hookimpl
    def titan_report():
        return {"hello": "world"}

    fake_module(
        "titan_fake_good", titan_register_patches=titan_register_patches, titan_report=titan_report
    )

    @hookimpl
    def titan_hook_from_the_future():
        return 1

    fake_module("titan_fake_future", titan_hook_from_the_future=titan_hook_from_the_future)
    eps = [
        fake_entry_point("good", "titan_fake_good", "titan-good", "1.2.3"),
        fake_entry_point("raises", "titan_fake_raises_on_load"),
        fake_entry_point("future", "titan_fake_future"),
    ]

    (tmp_path / "titan_fake_raises_on_load.py").write_text(
        "raise RuntimeError('broken on purpose')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return eps


def test_good_plugin_loads_with_distribution_info(plugins):
    pm = get_plugin_manager(entry_points=plugins)
    good = pm.records["good"]
    assert (good.state, good.distribution, good.version) == (ENABLED, "titan-good", "1.2.3")
    assert pm.hook.titan_report() == [{"hello": "world"}]


def test_failing_import_is_recorded_and_isolated(plugins):
    pm = get_plugin_manager(entry_points=plugins)
    assert pm.records["raises"].state == FAILED
    assert "RuntimeError: broken on purpose" in pm.records["raises"].reason
    assert pm.records["good"].state == ENABLED


def test_unknown_hook_unregisters_with_reason(plugins):
    pm = get_plugin_manager(entry_points=plugins)
    future = pm.records["future"]
    assert future.state == FAILED and "titan_hook_from_the_future" in future.reason
    assert pm.get_plugin("future") is None


def test_disabled_plugin_is_blocked_before_load(plugins, monkeypatch):
    monkeypatch.setenv("TITAN_PLUGINS_DISABLE", "raises")
    pm = get_plugin_manager(entry_points=plugins)
    assert pm.records["raises"].state == DISABLED
    assert pm.is_blocked("raises")


def test_master_switch_blocks_everything(plugins, monkeypatch):
    monkeypatch.setenv("TITAN_PLUGINS", "0")
    pm = get_plugin_manager(entry_points=plugins)
    assert {r.state for r in pm.records.values()} == {DISABLED}


def test_duplicate_names_are_reported(plugins):
    dup = fake_entry_point("good", "titan_fake_good", "titan-good-fork")
    pm = get_plugin_manager(entry_points=[*plugins, dup])
    assert pm.records["good"].state == ENABLED
    assert pm.records["good@titan-good-fork"].state == FAILED
