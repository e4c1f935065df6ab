"""The patch engine: order, idempotence, rollback, undo, version gates, import timing."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from titan_plugins.patching import (
    APPLIED,
    FAILED,
    MISSING,
    PENDING,
    SKIPPED,
    Patch,
    PatchEngine,
    PatchError,
    PatchWatcher,
)

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh importable package ``titan_tgt_<n>`` with a target module and a user module."""
    name = f"titan_tgt_{abs(hash(tmp_path)) % 10**8}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "target.py").write_text(
        textwrap.dedent(
            """
            def f(x):
                return x + 1

            class C:
                @staticmethod
                def s():
                    return "static"

                def m(self):
                    return "method"

            FLAG = 1
            """
        )
    )
    (root / "user.py").write_text(f"from {name}.target import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[mod]


def patch(pid: str, target: str, replace, **kw) -> Patch:
    return Patch(id=pid, target=target, replace=replace, rationale="test", remove_when="test", **kw)


def times(k):
    return lambda orig: (lambda x: orig(x) * k)


def plus(k):
    return lambda orig: (lambda x: orig(x) + k)


def test_post_exec_patch_reaches_from_import_copies(pkg):
    engine = PatchEngine()
    watcher = PatchWatcher(engine)
    watcher.install()
    try:
        engine.register(patch("t.f", f"{pkg}.target:f", times(10)))
        assert engine.patches()[0].status == PENDING
        user = importlib.import_module(f"{pkg}.user")  # imports target first, then copies f
        assert user.f(1) == 20  # the copy made by `from x import f` is the patched one
        assert engine.patches()[0].status == APPLIED
    finally:
        engine.undo()
        watcher.remove()
    assert sys.modules[f"{pkg}.target"].f(1) == 2


def test_chain_order_is_registration_order(pkg):
    target = importlib.import_module(f"{pkg}.target")
    engine = PatchEngine()
    engine.register(patch("a", f"{pkg}.target:f", times(10)))
    engine.register(patch("b", f"{pkg}.target:f", plus(3)))
    assert target.f(1) == (1 + 1) * 10 + 3  # b wraps a wraps the original
    engine.undo()
    assert target.f(1) == 2


def test_idempotent_second_application_does_not_stack(pkg):
    target = importlib.import_module(f"{pkg}.target")
    engine = PatchEngine()
    engine.register(patch("a", f"{pkg}.target:f", times(10)))
    engine.apply_ready()
    engine.apply_module(target, fresh=False)
    assert target.f(1) == 20
    engine.undo()
    assert target.f(1) == 2


def test_failed_factory_rolls_back_whole_chain(pkg):
    target = importlib.import_module(f"{pkg}.target")
    original = target.f
    engine = PatchEngine()
    engine.register(patch("good", f"{pkg}.target:f", times(10)))

    def boom(orig):
        raise RuntimeError("boom")

    engine.register(patch("bad", f"{pkg}.target:f", boom))
    assert target.f is original  # all-or-nothing: the good one is rolled back too
    status = {p.id: (p.status, p.detail) for p in engine.patches()}
    assert status["bad"][0] == FAILED and "boom" in status["bad"][1]
    assert status["good"][0] == FAILED and "rolled back" in status["good"][1]


def test_strict_turns_failure_into_error(pkg, monkeypatch):
    importlib.import_module(f"{pkg}.target")
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    engine = PatchEngine()
    with pytest.raises(PatchError, match="no 'nope'"):
        engine.register(patch("missing", f"{pkg}.target:nope", times(2)))


def test_missing_target_failed_or_skipped_when_optional(pkg):
    importlib.import_module(f"{pkg}.target")
    engine = PatchEngine()
    engine.register(patch("req", f"{pkg}.target:nope", times(2)))
    engine.register(patch("opt", f"{pkg}.target:nope2", times(2), optional=True))
    status = {p.id: p.status for p in engine.patches()}
    assert status == {"req": FAILED, "opt": SKIPPED}


def test_create_adds_and_undo_deletes(pkg):
    target = importlib.import_module(f"{pkg}.target")
    seen = []
    engine = PatchEngine()
    engine.register(
        patch("c", f"{pkg}.target:NEW", lambda orig: seen.append(orig) or 42, create=True)
    )
    assert seen == [MISSING] and target.NEW == 42
    engine.undo()
    assert not hasattr(target, "NEW")


def test_undo_restores_only_what_is_still_ours(pkg):
    target = importlib.import_module(f"{pkg}.target")
    engine = PatchEngine()
    engine.register(patch("a", f"{pkg}.target:f", times(10)))

    def third_party(x):
        return -x

    target.f = third_party
    left = engine.undo()
    assert target.f is third_party and left == [f"{pkg}.target:f"]
    assert engine.patches()[0].detail.startswith("not restored")


def test_class_attributes_keep_descriptors(pkg):
    target = importlib.import_module(f"{pkg}.target")
    raw = target.C.__dict__["s"]
    engine = PatchEngine()
    engine.register(patch("s", f"{pkg}.target:C.s", lambda orig: staticmethod(lambda: "patched")))
    engine.register(patch("m", f"{pkg}.target:C.m", lambda orig: lambda self: orig(self) + "!"))
    assert target.C.s() == "patched" and target.C().m() == "method!"
    engine.undo()
    assert target.C.__dict__["s"] is raw and target.C().m() == "method"


def test_late_application_rebinds_aliases_and_undo_restores_them(pkg, monkeypatch):
    monkeypatch.setattr("titan_plugins.patching.engine.ALIAS_PREFIXES", (pkg,))
    target = importlib.import_module(f"{pkg}.target")
    user = importlib.import_module(f"{pkg}.user")
    engine = PatchEngine()
    engine.register(patch("a", f"{pkg}.target:f", times(10)))
    assert user.f(1) == 20 and "late" in engine.patches()[0].detail
    engine.undo()
    assert user.f is target.f and user.f(1) == 2


def test_reload_reapplies_from_the_fresh_module(pkg):
    engine = PatchEngine()
    watcher = PatchWatcher(engine)
    watcher.install()
    try:
        engine.register(patch("a", f"{pkg}.target:f", times(10)))
        target = importlib.import_module(f"{pkg}.target")
        assert target.f(1) == 20
        importlib.reload(target)
        assert target.f(1) == 20  # re-applied once on the fresh original, not stacked
    finally:
        engine.undo()
        watcher.remove()
    assert target.f(1) == 2


@pytest.mark.parametrize(
    ("gate", "ok"),
    [
        ("pluggy>=1.0", True),
        ("pluggy<1.0", False),
        ("pluggy>=1.5,<2", True),
        ("pluggy==1.*", True),
        ("pluggy!=1.*", False),
        ("pluggy~=1.0", True),
        ("no-such-distribution-xyz>=1", False),
    ],
)
def test_version_gates(pkg, gate, ok):
    target = importlib.import_module(f"{pkg}.target")
    engine = PatchEngine()
    engine.register(patch("g", f"{pkg}.target:f", times(10), requires=(gate,)))
    assert (target.f(1) == 20) is ok
    assert engine.patches()[0].status == (APPLIED if ok else SKIPPED)
    engine.undo()


def test_version_key_orders_prereleases_before_release():
    from titan_plugins.patching.gates import version_key

    assert version_key("0.16.0rc0") < version_key("0.16.0") < version_key("0.16.1")
    assert version_key("0.17.0.dev0") < version_key("0.17")
    assert version_key("2.13.0+cpu") == version_key("2.13")


def test_two_engines_watching_one_module_both_apply(pkg):
    first, second = PatchEngine(), PatchEngine()
    w1, w2 = PatchWatcher(first), PatchWatcher(second)
    w1.install()
    w2.install()
    try:
        first.register(patch("a", f"{pkg}.target:f", times(10)))
        second.register(patch("b", f"{pkg}.target:FLAG", lambda orig: orig + 1))
        target = importlib.import_module(f"{pkg}.target")
        assert target.f(1) == 20 and target.FLAG == 2
    finally:
        second.undo()
        first.undo()
        w1.remove()
        w2.remove()


def test_patch_record_requires_rationale_and_remove_when():
    with pytest.raises(ValueError, match="rationale"):
        Patch(id="x", target="m:a", replace=lambda o: o, rationale="", remove_when="later")
    with pytest.raises(ValueError, match="module:attr"):
        Patch(id="x", target="m.a", replace=lambda o: o, rationale="r", remove_when="later")
