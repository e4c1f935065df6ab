"""Start here: the plugin's patch applies through the real engine and undoes cleanly, its knob
is validated, and its training-step wrapper passes Megatron's result through.

Run with the plugin installed (``python -m pip install -e .``): ``python -m pytest tests``.
"""

from __future__ import annotations

import logging

import pytest
from titan_PLUGIN_NAME import patches
from titan_PLUGIN_NAME.plugin import STEPS
from titan_PLUGIN_NAME.settings import LOG_EVERY

from titan_plugins import active_manager
from titan_plugins.hosts.megatron.train_step import TrainStep
from titan_plugins.settings import SettingError
from titan_plugins.testing import environ, plugin_active
from titan_plugins.verify.selection import load


def test_patches_apply_and_undo():
    import megatron.core.parallel_state as ps

    original = ps.initialize_model_parallel
    with plugin_active("PLUGIN_NAME") as engine:
        assert {p.status for p in engine.patches() if p.plugin == "PLUGIN_NAME"} == {"applied"}
        assert ps.initialize_model_parallel.__wrapped__ is original
    assert ps.initialize_model_parallel is original


def test_every_patch_names_the_upstream_tests_that_exercise_it():
    # upstream_tests.json (shipped in the package): which Megatron-LM unit tests call each
    # patch's target (to run with the plugin off and on), or why none does
    coverage = load("titan_PLUGIN_NAME").coverage(patches.patches())
    assert coverage.problems() == []


def test_bad_knob_value_warns_and_strict_refuses_it(caplog):
    with environ({LOG_EVERY.name: "-1"}), caplog.at_level(logging.WARNING):
        assert LOG_EVERY.read() == LOG_EVERY.default
    assert f"{LOG_EVERY.name}='-1'" in caplog.text
    with environ({LOG_EVERY.name: "-1", "TITAN_PLUGINS_STRICT": "1"}):
        with pytest.raises(SettingError, match=LOG_EVERY.name):
            LOG_EVERY.read()


def test_train_step_wrapper_passes_the_result_through():
    def schedule(**kwargs):  # stands in for Megatron's forward_backward_* function
        return [{"lm loss": 1.0}] * kwargs["num_microbatches"]

    before = STEPS["trained"]
    with plugin_active("PLUGIN_NAME"):
        step = TrainStep(schedule, (), {"num_microbatches": 2}, schedule="1f1b")
        assert active_manager().hook.titan_train_step(step=step) == [{"lm loss": 1.0}] * 2
    assert STEPS["trained"] == before + 1
