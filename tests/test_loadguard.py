"""The benchmarks' load guard judges the load before the benchmark's own work."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
loadguard = importlib.import_module("loadguard")


@pytest.fixture
def guard(monkeypatch):
    """A fresh guard whose load average the test sets."""
    mod = importlib.reload(loadguard)
    state = {"load": 0.2}
    monkeypatch.setattr(mod, "load", lambda: (state["load"], 0.0, 0.0))
    return mod, state


def _args(force: bool = False) -> argparse.Namespace:
    return argparse.Namespace(force=force, max_load=1.5)


def test_the_load_before_the_run_decides(guard):
    mod, state = guard
    mod.describe(_args())  # quiet machine before the run
    state["load"] = 2.1  # the benchmark's own two processes raise it
    assert mod.verdict(True, _args()) == "met"
    assert mod.verdict(False, _args()) == "NOT met"


def test_a_busy_machine_before_the_run_withholds_the_verdict(guard):
    mod, state = guard
    state["load"] = 1.9
    mod.describe(_args())
    state["load"] = 0.1
    assert mod.verdict(True, _args()).startswith("no verdict: load 1.90 before the run > 1.50")
    assert mod.verdict(True, _args(force=True)) == "met (forced at load 1.90 before the run)"


def test_without_a_header_the_current_load_decides(guard):
    mod, state = guard
    state["load"] = 1.7
    assert mod.verdict(True, _args()).startswith("no verdict: load 1.70 now")


def test_an_unmet_goal_can_say_why_and_is_still_withheld_when_busy(guard):
    mod, state = guard
    mod.describe(_args())
    why = "NOT met (Mooncake's TCP transport caps any protocol at 0.50x here)"
    assert mod.verdict(False, _args(), why) == why
    assert mod.verdict(True, _args(), why) == "met"
    mod = importlib.reload(mod)
    state["load"] = 1.9
    mod.load = lambda: (state["load"], 0.0, 0.0)
    mod.describe(_args())
    assert mod.verdict(False, _args(), why).startswith("no verdict")
    assert (
        mod.verdict(False, _args(force=True), why) == why + " (forced at load 1.90 before the run)"
    )
