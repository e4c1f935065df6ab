"""All there or not at all: a feature whose patches are not all applied stands aside, and says so.

The FP8 linear layers need the FP8 regions, both linear classes (one variant each) and the step
boundary that re-quantizes weights (the core's train-step patches). If one is missing on the
imported Megatron, nothing runs in FP8 (not the attention projections in FP8 and the MLPs in high
precision), the report says ``active: False`` with the reason, and the effects say
``stepped_aside`` instead of a row of zeros.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from titan_fp8_blockwise import backend, features, plugin
from titan_fp8_blockwise.patches import patches

from titan_plugins import platform
from titan_plugins.patching import APPLIED, OTHER_LINE, SKIPPED

ROW = "fp8_blockwise.RowParallelLinear"
SKIP_DETAIL = "signature: RowParallelLinear._forward_impl does not accept no_such_parameter"


@pytest.fixture
def records(monkeypatch):
    """The plugin's records as the engine would leave them on a 0.16-0.17 Megatron: the 0.19
    linear variants and the 0.18+ recompute one 'other line', everything else applied. Tracked
    as the current activation's."""
    from titan_fp8_blockwise import effects

    monkeypatch.setattr(platform, "probe_te_blockwise", lambda: platform.Probe(False, "no TE", ""))
    backend.reset()
    effects.reset()
    mine = {p.id: p for p in patches()}
    for record in mine.values():
        gtp = record.id.endswith(".gtp") or record.id.endswith(".recompute")
        record.set_status(OTHER_LINE if gtp else APPLIED, "written for another line" * gtp)
    features.track(list(mine.values()))
    yield mine
    features.track([])
    backend.reset()


def _config() -> SimpleNamespace:
    return SimpleNamespace(fp8="e4m3", fp8_recipe="blockwise", hidden_size=128)


def test_fp8_features_all_applied_is_active(records):
    assert features.status() == dict.fromkeys(features.FEATURES, "active")
    assert backend.recipe_for(_config()) is not None
    report = plugin.titan_report()
    assert report["active"] is True and "inactive_reason" not in report
    assert "stepped_aside" not in plugin.titan_effects()


def test_fp8_features_a_skipped_linear_class_steps_every_fp8_path_aside(records, caplog):
    records[ROW].set_status(SKIPPED, SKIP_DETAIL)
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        assert backend.recipe_for(_config()) is None  # no FP8 region opens: nothing runs in FP8
        assert backend.recipe_for(_config()) is None
    why = (
        "stepped aside (the FP8 linear layers): patches not applied on this Megatron: "
        f"{ROW} skipped ({SKIP_DETAIL}); {ROW}.gtp other line (written for another line). "
        "Megatron's own code runs there instead (TE's when installed, else high precision); "
        "`titan-plugins list --import-targets` shows every patch"
    )
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fp8_blockwise")]
    assert said == [f"fp8_blockwise: {why}"]  # once
    report = plugin.titan_report()
    assert report["active"] is False and report["inactive_reason"] == why
    # the features that run inside FP8 regions stand aside with it; the config fix does not
    assert report["features"]["swiglu_store"].startswith("stepped aside (the blockwise-FP8")
    assert report["features"]["moe_config"] == "active"
    assert plugin.titan_effects() == {"stepped_aside": f"not applied: {ROW} / {ROW}.gtp"}
    records[f"{ROW}.gtp"].set_status(APPLIED)  # the variant for this line is there after all
    assert backend.recipe_for(_config()) is not None and plugin.titan_report()["active"]


def test_fp8_features_no_step_boundary_means_no_fp8_weights_cache(records, monkeypatch):
    # Without the core's train-step patch the weight cache never learns that a step ended, and
    # megatron's optimizers update weights without bumping their version: stale FP8 weights.
    step = SimpleNamespace(
        id="core.train_step.no_pipelining", status=SKIPPED, detail="signature: changed"
    )
    monkeypatch.setattr(features, "_core_step_records", lambda: [step])
    assert backend.recipe_for(_config()) is None
    assert (
        "core.train_step.no_pipelining skipped (signature: changed)"
        in (plugin.titan_report()["inactive_reason"])
    )


def test_fp8_features_pending_patches_do_not_step_aside(records):
    # A patch whose module has not been imported yet cannot have run either: not a reason.
    from titan_plugins.patching import PENDING

    records[ROW].set_status(PENDING)
    records[f"{ROW}.gtp"].set_status(PENDING)
    assert features.inactive_reason() is None and backend.recipe_for(_config()) is not None


def test_fp8_features_half_a_swiglu_store_uses_megatrons_for_both(records):
    from titan_fp8_blockwise.patches import _wrap_bias_swiglu
    from titan_fp8_blockwise.recipe import BlockwiseRecipe
    from titan_fp8_blockwise.region import fp8_region

    records["fp8_blockwise.weighted_bias_swiglu_impl"].set_status(SKIPPED, "signature: changed")
    seen = []

    def megatron(*args):
        seen.append(args)
        return "megatron's store"

    with fp8_region(BlockwiseRecipe()):
        assert _wrap_bias_swiglu(megatron)("x", None, True, False) == "megatron's store"
    assert seen == [("x", None, True, False)]
    assert plugin.titan_report()["active"] is True  # the linear layers are unaffected


def _half_patched_task(steps: int) -> dict:
    """Worker task: RowParallelLinear's records cannot match this Megatron (an impossible
    signature, as a fork or a new line would); train the FP8 MoE GPT with the plugin on."""
    from titan_fp8_blockwise import effects, region
    from titan_fp8_blockwise import patches as records_module
    from titan_fp8_blockwise import plugin as fp8_plugin

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.patching import Signature
    from titan_plugins.testing.activation import plugin_active

    original = records_module.patches

    def with_row_unmatched() -> list:
        out = original()
        for record in out:
            if record.id.startswith(ROW):
                record.signature = (Signature(params=("no_such_parameter",)),)
        return out

    tiny_gpt.init_parallel()
    records_module.patches = with_row_unmatched
    try:
        with plugin_active("fp8_blockwise", {}) as engine:
            effects.reset()
            cfg = tiny_gpt.make_config(fp8="e4m3", fp8_recipe="blockwise")
            losses, _ = tiny_gpt.train(tiny_gpt.build_model(cfg), cfg, steps, num_microbatches=1)
            report = fp8_plugin.titan_report()
            return {
                "losses": losses,
                "calls": dict(region.CALLS),
                "report": {k: report.get(k) for k in ("active", "inactive_reason")},
                "effects": fp8_plugin.titan_effects(),
                "row": {p.id: p.status for p in engine.patches() if p.id.startswith(ROW)},
            }
    finally:
        records_module.patches = original


def _reference_task(steps: int) -> list[float]:
    """Worker task: the same model without FP8 flags and without the plugin."""
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_config()
    return tiny_gpt.train(tiny_gpt.build_model(cfg), cfg, steps, num_microbatches=1)[0]


@pytest.mark.multiprocess
def test_fp8_features_megatron_with_one_linear_class_unpatched_runs_no_fp8(gloo_pool1):
    run = gloo_pool1.run(_half_patched_task, 2)[0]
    assert "skipped" in run["row"].values()
    assert run["calls"] == {}  # not one layer in FP8: Column alone would be half patched
    assert run["report"]["active"] is False
    assert f"{ROW}" in run["report"]["inactive_reason"]
    assert "no_such_parameter" in run["report"]["inactive_reason"]
    assert run["effects"]["stepped_aside"].startswith(f"not applied: {ROW}")
    assert run["losses"] == gloo_pool1.run(_reference_task, 2)[0]  # megatron's own math
