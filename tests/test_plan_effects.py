"""``plan`` asks plugins for their memory effect (``titan_memory_effect``) and applies it."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest

from titan_plugins import hookimpl, manager
from titan_plugins.plan.cli import plan_from_argv
from titan_plugins.plan.effects import MemoryEffect, MemoryLayout, ask_plugins, variants
from titan_plugins.plan.flags import parse_flags
from titan_plugins.plan.from_flags import build_config
from titan_plugins.plan.memory import stage_memory, stage_schedule
from titan_plugins.plan.report import build_report, render_text
from titan_plugins.testing import fake_entry_point, fake_module

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

SMALL = (
    "--num-layers 4 --hidden-size 512 --num-attention-heads 4 --seq-length 512 "
    "--micro-batch-size 1 --vocab-size 128 --bf16 --pipeline-model-parallel-size 4 "
    "--global-batch-size 8"
).split()

HALVE = MemoryEffect(
    "halve",
    "h",
    "half storage",
    "TITAN_HALVE=1",
    "--halve",
    "everything at half size",
    stored_bytes=lambda tensor, size: size / 2,
)
AWAY = MemoryEffect(
    "away",
    "a",
    "all away",
    "TITAN_AWAY=1",
    description="every saved tensor to host",
    offloaded=lambda tensors, sizes: [True] * len(tensors),
    resident_units=1,
)


def _config():
    return build_config(parse_flags(SMALL), world=4)


def test_effects_apply_alone_and_together() -> None:
    """Storage halves every peak; offloading all but the newest unit leaves one unit's bytes;
    both together leave half a unit. Storage effects come first, whatever the order given."""
    stages = stage_memory(_config(), effects=[AWAY, HALVE])
    for stage in stages:
        acts, per_mb = stage.activations, stage.act_per_microbatch
        assert list(acts) == ["configured", "halve", "away", "halve+away"]
        assert acts["configured"] == pytest.approx(stage.in_flight * per_mb)
        assert acts["halve"] == pytest.approx(acts["configured"] / 2)
        assert acts["away"] == pytest.approx(per_mb)
        assert acts["halve+away"] == pytest.approx(per_mb / 2)
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]


def test_report_labels_and_advice_come_from_the_effects() -> None:
    rep = build_report(_config(), device_bytes=1.0, effects=[HALVE, AWAY])
    assert [v["label"] for v in rep["variants"]] == ["+h", "+a", "+both"]
    assert rep["advice"][0].startswith("TITAN_HALVE=1 with --halve (everything at half size)")
    assert rep["advice"][2].startswith("both TITAN_HALVE=1 (+ --halve) and TITAN_AWAY=1:")
    text = render_text(rep)
    assert "+h / +a / +both: with half storage, all away, both" in text
    assert "     +h      +a   +both" in text
    bare = build_report(_config(), effects=())
    assert bare["variants"] == [] and list(bare["stages"][0]["peak_bytes"]) == ["configured"]
    assert "+both" not in render_text(bare)


class _Plugin:
    """A plugin answering the hook with ``effect`` (or raising it)."""

    def __init__(self, effect: object) -> None:
        self.effect = effect

    @hookimpl
    def titan_memory_effect(self, layout: MemoryLayout) -> object:
        if isinstance(self.effect, Exception):
            raise self.effect
        return self.effect


def test_ask_plugins_asks_every_installed_plugin_on_or_off(monkeypatch, caplog) -> None:
    """A switched-off plugin is still asked (the plan shows what switching it on does); one that
    raises or answers something else is left out with a warning, the others still count."""
    answers = {
        "halve": HALVE,
        "off_one": AWAY,
        "broken": RuntimeError("boom"),
        "odd": "not an effect",
        "quiet": None,
    }
    eps: list[metadata.EntryPoint] = []
    for name, answer in answers.items():
        fake_module(f"titan_fake_{name}", plugin=_Plugin(answer))
        eps.append(fake_entry_point(name, f"titan_fake_{name}:plugin"))
    monkeypatch.setattr(manager, "discover", lambda: eps)
    monkeypatch.setenv("TITAN_OFF_ONE", "0")
    layout = MemoryLayout(_config(), resident_units=3)
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        effects = ask_plugins(layout)
    assert sorted(e.plugin for e in effects) == ["away", "halve"]
    assert "broken's titan_memory_effect raised" in caplog.text
    assert "odd's titan_memory_effect returned 'str'" in caplog.text


def _installed(*plugins: str) -> bool:
    names = {ep.name for ep in metadata.entry_points(group="titan_plugins")}
    return all(p in names for p in plugins)


@pytest.mark.skipif(
    not _installed("fp8_blockwise", "act_offload"), reason="the two plugins are not installed"
)
def test_fp8_storage_and_offload_reduce_activations() -> None:
    """Through the real hook: the installed fp8_blockwise and act_offload state their effects."""
    rep = plan_from_argv(["--world-size", "4", "--", *SMALL], env={})
    assert [v["name"] for v in rep["variants"]] == [
        "fp8_blockwise",
        "act_offload",
        "fp8_blockwise+act_offload",
    ]
    acts = rep["stages"][0]["activation_peak_bytes"]
    assert acts["fp8_blockwise"] < acts["configured"]
    assert acts["act_offload"] < acts["configured"]
    assert acts["fp8_blockwise+act_offload"] < min(acts["fp8_blockwise"], acts["act_offload"])
    # the last stage runs each backward right after its forward: nothing waits, nothing moves
    last = rep["stages"][-1]["activation_peak_bytes"]
    assert last["act_offload"] == last["configured"]


@pytest.mark.skipif(not _installed("act_offload"), reason="titan-act-offload not installed")
def test_act_offload_effect_follows_its_size_knob(monkeypatch) -> None:
    """The plugin reads its own minimum size: above every tensor, nothing moves."""
    cfg = _config()
    stage = stage_memory(cfg)[0]
    assert stage.activations["act_offload"] < stage.activations["configured"]
    monkeypatch.setenv("TITAN_ACT_OFFLOAD_MIN_BYTES", "1G")
    stage = stage_memory(cfg)[0]
    assert stage.activations["act_offload"] == stage.activations["configured"]


def test_variants_order_and_names() -> None:
    shown = variants([AWAY, HALVE])
    assert [(v.name, v.label, v.legend) for v in shown] == [
        ("configured", "act", ""),
        ("halve", "+h", "half storage"),
        ("away", "+a", "all away"),
        ("halve+away", "+both", "both"),
    ]
    assert shown[2].resident_units == 1 and shown[1].resident_units is None
    assert stage_schedule(_config(), 0).in_flight_peak() == 4
