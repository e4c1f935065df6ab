"""The plugin as the registry sees it: discovery, switches, knobs, report, doctor, CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from titan_rewind import settings

from titan_plugins.hosts.megatron import train_step
from titan_plugins.testing import environ, fresh_manager, plugin_active

LOOP_HOOKS = ("titan_train_step", "titan_optimizer_step", "titan_forward_microbatch")


def _impls(pm, hook: str) -> list[str]:
    return [impl.plugin_name for impl in getattr(pm.hook, hook).get_hookimpls()]


def test_discovered_enabled_and_wrapping_the_loop_hooks():
    pm = fresh_manager(only=["rewind"])
    record = pm.records["rewind"]
    assert (record.state, record.distribution) == ("enabled", "titan-rewind")
    for hook in LOOP_HOOKS:
        assert "rewind" in _impls(pm, hook)
        (impl,) = [i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin_name == "rewind"]
        assert impl.wrapper


def test_titan_rewind_0_switches_it_off():
    with environ({"TITAN_REWIND": "0"}):
        pm = fresh_manager(only=["rewind"])
    assert pm.records["rewind"].state == "disabled"
    assert "TITAN_REWIND=0" in pm.records["rewind"].reason
    for hook in LOOP_HOOKS:
        assert "rewind" not in _impls(pm, hook)


def test_activation_starts_a_fresh_state_machine_and_reports_it():
    import titan_rewind
    from titan_rewind import runtime

    with plugin_active("rewind", {"TITAN_REWIND_INTERVAL": "3", "TITAN_REWIND_DETECT": "loss"}):
        rewinder = runtime.current()
        assert rewinder.config.interval == 3 and rewinder.config.detect == ("loss",)
        report = titan_rewind.effect()
        assert report["active"] and report["rewinds"] == 0 and report["snapshots"] == []
        json.dumps(report, allow_nan=False)  # strict JSON for report --json and the demo
    with plugin_active("rewind"):
        assert runtime.current() is not rewinder and runtime.current().config.interval == 10


def test_every_knob_is_declared_once_and_bad_values_are_named():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) and all(n.startswith("TITAN_REWIND_") for n in names)
    with environ({"TITAN_REWIND_INTERVAL": "0", "TITAN_REWIND_INJECT_NAN_STEP": "3,x"}):
        problems = [s.problem() for s in settings.SETTINGS if s.problem()]
    assert any("TITAN_REWIND_INTERVAL='0'" in p and ">= 1" in p for p in problems)
    assert any("TITAN_REWIND_INJECT_NAN_STEP" in p and "x not a step index" in p for p in problems)
    with environ({"TITAN_REWIND_DETECT": "loss,bogus"}):
        assert "bogus" in settings.DETECT.problem()


def test_doctor_checks_the_budget():
    from titan_rewind.doctor import checks, estimate_bytes

    from titan_plugins.doctor import FAIL, OK

    with environ({"TITAN_REWIND_MAX_HOST_BYTES": "1G"}):
        by_name = {c.name: c for c in checks()}
    assert by_name["rewind.host_budget"].status == OK
    with environ({"TITAN_REWIND_MAX_HOST_BYTES": "1000T"}):
        budget = {c.name: c for c in checks()}["rewind.host_budget"]
    assert budget.status == FAIL and "TITAN_REWIND_MAX_HOST_BYTES" in budget.fix
    # bf16 + Adam: 2 + 12 bytes per parameter unsharded, 2 + 12/DP sharded; two snapshots.
    assert estimate_bytes(1000) == 2 * 14 * 1000
    assert estimate_bytes(1000, dp_shards=4) == 2 * (2000 + 3000)


def test_titan_plugins_list_shows_it():
    from titan_plugins import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["list"]) == 0
    text = out.getvalue()
    assert "rewind  [titan-rewind" in text and "snapshots_taken" in text


def test_restore_refuses_to_run_inside_a_schedule(monkeypatch):
    from titan_rewind import RewindError
    from titan_rewind.loop import assert_between_steps

    assert_between_steps()  # between steps: fine
    fake = train_step.TrainStep(print, (), {}, schedule="1f1b")
    monkeypatch.setattr(train_step._STATE, "step", fake)
    with pytest.raises(RewindError, match="inside a running 1f1b schedule"):
        assert_between_steps()


def test_warns_once_when_megatrons_nan_check_would_stop_the_run(caplog):
    from types import SimpleNamespace

    from titan_rewind.config import RewindConfig
    from titan_rewind.runtime import Rewinder

    chunk = SimpleNamespace(ddp_config=SimpleNamespace(check_for_nan_in_grad=True))
    step = SimpleNamespace(index=0, num_microbatches=1, model=[chunk])
    rewinder = Rewinder(RewindConfig())
    with caplog.at_level("WARNING", logger="titan_plugins.rewind"):
        rewinder.after_train_step(step, [])
        rewinder.after_train_step(step, [])
    (record,) = [r for r in caplog.records if "check_for_nan_in_grad" in r.getMessage()]
    assert "--no-check-for-nan-in-loss-and-grad" in record.getMessage()
    quiet = Rewinder(RewindConfig(detect=("loss",)))  # NaN handling left to megatron: no advice
    caplog.clear()
    quiet.after_train_step(step, [])
    assert not caplog.records


def test_a_gather_inside_the_optimizer_step_turns_snapshots_off():
    from types import SimpleNamespace

    from titan_rewind.loop import unsupported

    racing = SimpleNamespace(config=SimpleNamespace(overlap_param_gather_with_optimizer_step=True))
    assert "overlap_param_gather_with_optimizer_step is on" in unsupported(racing)
    assert unsupported(SimpleNamespace(config=SimpleNamespace())) == ""
