"""Discovery with fake distributions: blocking before load, failures isolated, unknown hooks."""

from __future__ import annotations

import logging

import pytest

from titan_plugins import hookimpl
from titan_plugins.manager import DISABLED, ENABLED, FAILED, get_plugin_manager
from titan_plugins.patching import Patch
from titan_plugins.testing import fake_entry_point, fake_module

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


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


def test_two_third_parties_claiming_one_name_both_wait_for_a_pick(plugins, monkeypatch, caplog):
    dup = fake_entry_point("good", "titan_fake_good", "titan-good-fork")
    pm = get_plugin_manager(entry_points=[*plugins, dup])
    assert "good" not in pm.records  # neither loads
    first, second = pm.records["good@titan-good"], pm.records["good@titan-good-fork"]
    assert first.state == second.state == FAILED
    assert "titan-good, titan-good-fork" in first.reason
    assert "TITAN_PLUGINS_PICK=good=<distribution>" in first.reason
    monkeypatch.setenv("TITAN_PLUGINS_PICK", "good=titan-good-fork")
    pm = get_plugin_manager(entry_points=[*plugins, dup])
    assert (pm.records["good"].state, pm.records["good"].distribution) == (
        ENABLED,
        "titan-good-fork",
    )
    assert "chose titan-good-fork" in pm.records["good@titan-good"].reason


def test_a_first_party_name_cannot_be_taken(plugins):
    fake_module("titan_fake_impostor")
    impostor = fake_entry_point("fp8_blockwise", "titan_fake_impostor", "evil-fp8")
    real = fake_entry_point("fp8_blockwise", "titan_fake_good", "titan-fp8-blockwise")
    pm = get_plugin_manager(entry_points=[impostor, real])
    assert (pm.records["fp8_blockwise"].state, pm.records["fp8_blockwise"].distribution) == (
        ENABLED,
        "titan-fp8-blockwise",
    )
    refused = pm.records["fp8_blockwise@evil-fp8"]
    assert refused.state == FAILED
    assert "belongs to titan-fp8-blockwise" in refused.reason and "evil-fp8" in refused.reason
    # Alone, an impostor still does not get the name.
    pm = get_plugin_manager(entry_points=[impostor])
    assert "fp8_blockwise" not in pm.records
    assert pm.records["fp8_blockwise@evil-fp8"].state == FAILED


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("plugins_debug", "reserved"),
        ("plugins", "reserved"),
        ("Fp8", "lower snake case"),
        ("my-plugin", "lower snake case"),
    ],
)
def test_reserved_and_malformed_names_are_refused(name, why):
    fake_module("titan_fake_named")
    pm = get_plugin_manager(entry_points=[fake_entry_point(name, "titan_fake_named", "x-dist")])
    assert name not in pm.records
    record = pm.records[f"{name}@x-dist"]
    assert record.state == FAILED and why in record.reason


def test_sys_exit_at_import_is_contained(tmp_path, monkeypatch, plugins):
    (tmp_path / "titan_fake_exits.py").write_text("import sys\nsys.exit(3)\n")
    pm = get_plugin_manager(entry_points=[*plugins, fake_entry_point("exits", "titan_fake_exits")])
    assert pm.records["exits"].state == FAILED
    assert "sys.exit(3)" in pm.records["exits"].reason
    assert pm.records["good"].state == ENABLED


def test_keyboard_interrupt_is_reported_then_raised(tmp_path, plugins, caplog):
    (tmp_path / "titan_fake_ctrlc.py").write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        get_plugin_manager(entry_points=[fake_entry_point("ctrlc", "titan_fake_ctrlc")])
    assert "plugin ctrlc not loaded" in caplog.text


def test_watchdog_names_a_plugin_whose_import_hangs(tmp_path, plugins, monkeypatch, caplog):
    monkeypatch.setattr("titan_plugins.manager.SLOW_IMPORT_S", 0.05)
    (tmp_path / "titan_fake_slow.py").write_text("import time\ntime.sleep(0.5)\n")
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        pm = get_plugin_manager(entry_points=[fake_entry_point("slow", "titan_fake_slow")])
    assert pm.records["slow"].state == ENABLED  # slow is not broken: it loads
    assert "plugin slow (fake-slow) is still importing after" in caplog.text
    assert "TITAN_PLUGINS_DISABLE=slow" in caplog.text


def test_training_loop_hooks_must_be_wrappers(plugins):
    @hookimpl
    def titan_train_step(step):
        return "replaced the schedule"

    @hookimpl(wrapper=True)
    def titan_optimizer_step(step):
        return (yield)

    fake_module("titan_fake_plain_step", titan_train_step=titan_train_step)
    fake_module("titan_fake_wrapping_step", titan_optimizer_step=titan_optimizer_step)
    pm = get_plugin_manager(
        entry_points=[
            fake_entry_point("plain", "titan_fake_plain_step"),
            fake_entry_point("wrapping", "titan_fake_wrapping_step"),
        ]
    )
    assert pm.records["plain"].state == FAILED
    assert "titan_train_step without wrapper=True" in pm.records["plain"].reason
    assert pm.get_plugin("plain") is None
    assert pm.records["wrapping"].state == ENABLED


def test_distribution_identity_reads_the_metadata_headers_as_the_parser_does():
    """``_identity`` reads Name and Version without the email parser: same answers."""
    from importlib import metadata as md

    from titan_plugins import manager

    dists = list(md.distributions())
    assert len(dists) > 10
    for dist in dists:
        parsed = dist.metadata
        expected = (parsed.get("Name") or "", parsed.get("Version") or "")
        assert manager._identity(dist) == expected, expected


def _dist_info(root, name: str, version: str, entry_points: str | None) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)


def test_discovery_finds_what_importlib_metadata_finds(tmp_path):
    """The text pre-filter is only a shortcut: same entry points, same shadowing rule."""
    from importlib import metadata as md

    from titan_plugins import manager

    first, second = tmp_path / "first", tmp_path / "second"
    group = "[titan_plugins]\n"
    # shadowed: the first copy on the path has no entry points, so the second's must not count
    _dist_info(first, "shadowed-plugin", "2.0", None)
    _dist_info(second, "shadowed-plugin", "1.0", group + "shadowed = titan_shadowed\n")
    _dist_info(first, "real-plugin", "1.0", "[console_scripts]\nx = a:b\n\n" + group + "real = r\n")
    _dist_info(first, "mentions-only", "1.0", "[console_scripts]\nt = titan_plugins.cli:main\n")
    _dist_info(second, "other-group", "1.0", "[pytest11]\np = q\n")
    path = [str(first), str(second)]

    def key(eps):
        return sorted((ep.name, ep.value, ep.dist.name) for ep in eps)

    expected = md.entry_points(group=manager.ENTRY_POINT_GROUP)
    assert key(manager.discover()) == key(expected)  # the environment's own plugins
    # the shadowed copy and the mere mention stay out, as entry_points() leaves them out
    assert key(manager.discover(path=path)) == [("real", "r", "real-plugin")]
