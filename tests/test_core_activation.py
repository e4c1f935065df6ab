"""Activation in-process: lazy autoload trigger, apply() idempotence, undo, failure isolation."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from titan_plugins import activation, arming, autoload, hookimpl
from titan_plugins.patching import APPLIED, Patch
from titan_plugins.testing import fake_entry_point, fake_module

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _returning(patch_id: str, target: str, value: str) -> Patch:
    """A test patch replacing the function at ``target`` by one that returns ``value``."""
    return Patch(
        id=patch_id,
        target=target,
        replace=lambda original: lambda: value,
        rationale="test",
        remove_when="test",
    )


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A fake 'megatron' package on disk and two fake plugins patching it (one is broken)."""
    for var in (
        "TITAN_PLUGINS",
        "TITAN_PLUGINS_AUTOLOAD",
        "TITAN_PLUGINS_DISABLE",
        "TITAN_PLUGINS_ONLY",
        "TITAN_PLUGINS_STRICT",
    ):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "megatron_fake_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text(
        textwrap.dedent("""
        def f():
            return "original"
    """)
    )
    (root / "user.py").write_text("from megatron_fake_pkg.mod import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    @hookimpl
    def titan_register_patches(register):
        register(_returning("good.f", "megatron_fake_pkg.mod:f", "patched"))

    @hookimpl
    def bad_register(register):
        register(_returning("bad.f2", "megatron_fake_pkg.mod:f", "bad"))
        raise RuntimeError("registration exploded")

    fake_module("titan_fake_good_plugin", titan_register_patches=titan_register_patches)
    bad = fake_module("titan_fake_bad_plugin")
    bad.titan_register_patches = bad_register
    eps = [
        fake_entry_point("good", "titan_fake_good_plugin"),
        fake_entry_point("bad", "titan_fake_bad_plugin"),
    ]
    monkeypatch.setattr("titan_plugins.manager.discover", lambda: eps)
    monkeypatch.setattr(autoload, "TRIGGER_PREFIXES", ("megatron_fake_pkg",))
    monkeypatch.setattr(arming, "_ARMED", None)
    monkeypatch.setattr(activation, "_CURRENT", None)
    yield
    activation.undo()
    for name in [m for m in sys.modules if m.startswith("megatron_fake_pkg")]:
        del sys.modules[name]


def test_autoload_arms_then_activates_on_first_import(world):
    imported_before = set(sys.modules)  # earlier tests of this process may have run megatron
    autoload.arm("torch.backends")
    assert activation.autoload_state()["state"].startswith("armed")
    assert activation.active() is None  # nothing loaded until the trigger package is imported
    user = importlib.import_module("megatron_fake_pkg.user")
    assert user.f() == "patched"  # from-import copy made after the post-exec patch
    assert activation.autoload_state()["state"] == "activated on first megatron import"
    # what the activation-overhead benchmark reads: time at the trigger and in patching
    state = activation.active()
    assert state is not None and state.engine is not None
    armed = autoload.armed()
    assert armed is not None and armed.fire_seconds >= state.seconds > 0
    assert state.engine.apply_seconds > 0
    # Time in patching while starting is spent only on targets imported before the trigger (the
    # core's Megatron patches, when megatron already ran in this process); the fake package's
    # patch applies after its module executes.
    preloaded = {p.target.split(":")[0] for p in state.engine.patches()} & imported_before
    assert "megatron_fake_pkg.mod" not in preloaded
    assert (state.applied_while_starting > 0) == bool(preloaded), preloaded


def test_failing_plugin_is_withdrawn_and_others_apply(world):
    state = activation.apply()
    mod = importlib.import_module("megatron_fake_pkg.mod")
    assert mod.f() == "patched"
    assert state.manager.records["bad"].state == "failed"
    assert "registration exploded" in state.manager.records["bad"].reason
    assert [p.id for p in state.engine.patches() if not p.id.startswith("core.")] == ["good.f"]


def test_apply_is_idempotent_and_undo_restores(world):
    mod = importlib.import_module("megatron_fake_pkg.mod")
    original = mod.f
    first = activation.apply()
    second = activation.apply()
    assert first is second and mod.f() == "patched"
    assert {p.id: p.status for p in first.engine.patches()}["good.f"] == APPLIED
    assert activation.undo() == []
    assert mod.f is original


def test_master_switch_and_autoload_switch(world, monkeypatch):
    monkeypatch.setenv("TITAN_PLUGINS_AUTOLOAD", "0")
    autoload.arm("torch.backends")
    assert activation.autoload_state()["state"] == "off: TITAN_PLUGINS_AUTOLOAD=0"
    mod = importlib.import_module("megatron_fake_pkg.mod")
    assert mod.f() == "original"
    activation.apply()  # explicit apply still works with autoload off
    assert mod.f() == "patched"
    activation.undo()
    monkeypatch.setenv("TITAN_PLUGINS", "0")
    state = activation.apply()
    assert state.inactive_reason == "TITAN_PLUGINS=0" and mod.f() == "original"


def test_autoload_never_raises(world, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("watcher exploded")

    monkeypatch.setattr(autoload.ImportTrigger, "install", explode)
    autoload.arm("torch.backends")  # must not raise
    assert "watcher exploded" in activation.autoload_state()["state"]


def test_a_lookup_does_not_activate_an_import_does(world):
    """``find_spec`` (availability checks, ``titan-plugins list``) finds megatron without
    loading plugins; executing the module fires the trigger."""
    import importlib.util

    autoload.arm("torch.backends")
    spec = importlib.util.find_spec("megatron_fake_pkg")
    assert spec is not None and spec.origin.endswith("__init__.py")
    assert activation.active() is None and autoload.armed().trigger.armed
    assert "megatron_fake_pkg" not in sys.modules
    user = importlib.import_module("megatron_fake_pkg.user")
    assert activation.active() is not None and not autoload.armed().trigger.armed
    assert user.f() == "patched"


def test_armed_late_the_next_module_is_patched_as_it_runs(world):
    """Armed while megatron is importing (torch imported from inside it): the trigger fires as
    the next module executes, and that module is itself a patch target."""
    importlib.import_module("megatron_fake_pkg")
    autoload.arm("torch.backends")
    assert autoload.armed().late
    mod = importlib.import_module("megatron_fake_pkg.mod")
    assert mod.f() == "patched"  # patched right after its own body ran
    assert activation.autoload_state()["state"] == "activated (megatron already importing)"


def test_a_module_found_while_armed_and_run_after_activation_is_patched(
    world, tmp_path, monkeypatch
):
    """Found by a lookup while armed, executed by hand after another channel activated: the
    watcher installed since still patches it as it runs, and no wrapper is left behind."""
    import importlib.util

    (tmp_path / "megatron_fake_top.py").write_text("def g():\n    return 'original'\n")

    @hookimpl
    def titan_register_patches(register):
        register(_returning("top.g", "megatron_fake_top:g", "patched"))

    fake_module("titan_fake_top_plugin", titan_register_patches=titan_register_patches)
    monkeypatch.setattr(
        "titan_plugins.manager.discover",
        lambda: [fake_entry_point("top", "titan_fake_top_plugin")],
    )
    monkeypatch.setattr(autoload, "TRIGGER_PREFIXES", ("megatron_fake_top",))
    autoload.arm("torch.backends")
    spec = importlib.util.find_spec("megatron_fake_top")  # wrapped by the armed trigger
    assert activation.active() is None
    activation.apply()  # another channel activates (and disarms the trigger)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        assert module.g() == "patched"
        assert type(module.__loader__).__name__ != "_FiringLoader"
        assert module.__spec__.loader is module.__loader__
    finally:
        del sys.modules[spec.name]
