"""moe_ep_overlap stands aside, and says so, where Megatron refuses the flex dispatcher (TP x EP =
1), and where the job selects Megatron's own path that overlaps the plugin's: it steps aside
(HybridEP, NCCL EP) or composes (its backend serves Megatron's own overlap, the chunk pipeline
stands aside), never dispatching twice; the demo runs of tests/test_demo.py check the layout case
through a real job, test_moe_ep_overlap_gpt the combined-1F1B EP overlap through megatron's
schedules."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from titan_moe_ep_overlap import bindings, moe_forward, plugin, stats, step_aside, upstream_paths

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


def _parallel_state(tp: int, ep: int, initialized: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        model_parallel_is_initialized=lambda: initialized,
        get_tensor_model_parallel_world_size=lambda: tp,
        get_expert_model_parallel_world_size=lambda: ep,
    )


@pytest.fixture
def layout(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def use(tp: int, ep: int, initialized: bool = True) -> None:
        fake = _parallel_state(tp, ep, initialized)
        monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", fake)

    stats.reset()
    upstream_paths.reset()
    yield use
    stats.reset()
    upstream_paths.reset()


def test_tp_x_ep_of_one_is_reported_as_standing_aside(layout) -> None:  # type: ignore[no-untyped-def]
    layout(1, 1)
    why = step_aside.reason()
    assert why is not None and "TP x EP > 1" in why and "--expert-model-parallel-size" in why
    assert plugin.titan_effects() == {"stepped_aside": "TP x EP = 1"}
    report = plugin.titan_report()
    assert report["active"] is False and report["inactive_reason"] == why
    stats.add("api_dispatches", 3)  # a caller of the DeepEP API still counts, and shows
    assert plugin.titan_effects() == {"stepped_aside": "TP x EP = 1", "api_dispatches": 3}


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1), (2, 4)])
def test_any_layout_megatron_accepts_is_served(layout, tp: int, ep: int) -> None:  # type: ignore[no-untyped-def]
    layout(tp, ep)
    assert step_aside.reason() is None
    assert "stepped_aside" not in plugin.titan_effects()
    assert plugin.titan_report()["active"] is True


def test_no_layout_yet_is_not_judged(layout, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    layout(1, 1, initialized=False)
    assert step_aside.reason() is None
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state")
    assert step_aside.reason() is None


# ------------------------------------------------------------ Megatron's own overlapping paths
def _flex_layer(**config) -> SimpleNamespace:
    base = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                sequence_parallel=False, moe_shared_expert_overlap=False)  # fmt: skip
    return SimpleNamespace(
        config=SimpleNamespace(**{**base, **config}), training=True,
        fwd_execution_map=["route", "expert_compute", "postprocess"],
        attn_tp_group=SimpleNamespace(size=lambda: 1),
    )  # fmt: skip


OWN_PATHS = [  # (config, what the effects table names, whether the backend still serves it)
    ({"moe_flex_dispatcher_backend": "hybridep"}, "moe_flex_dispatcher_backend=hybridep", False),
    ({"moe_flex_dispatcher_backend": "ncclep"}, "moe_flex_dispatcher_backend=ncclep", False),
    ({"overlap_moe_expert_parallel_comm": True}, "overlap_moe_expert_parallel_comm", True),
    ({"overlap_dispatch_backward_with_experts_wgrad": True},
     "overlap_dispatch_backward_with_experts_wgrad", True),
    ({"moe_shared_expert_overlap": True}, "moe_shared_expert_overlap", True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "option", "composes"), OWN_PATHS, ids=[o for _, o, _ in OWN_PATHS]
)
def test_megatron_s_own_path_runs_alone_and_is_named(
    layout, monkeypatch: pytest.MonkeyPatch, config: dict, option: str, composes: bool
) -> None:  # type: ignore[no-untyped-def]
    """With the pipeline configured (4 chunks, no automatic choice), a layer whose config selects
    Megatron's own path runs megatron's forward once and the pipeline not at all; list/report
    and the effects table say which path and whether the plugin composes or steps aside."""
    layout(1, 2)
    monkeypatch.setenv("TITAN_MOE_EP_OVERLAP_CHUNKS", "4")
    monkeypatch.setenv("TITAN_MOE_EP_OVERLAP_AUTO", "0")
    calls = []
    forward = moe_forward.make_forward(lambda *args: calls.append(args) or ("out", None), "0.19")
    assert forward(_flex_layer(**config), torch.zeros(4, 1, 8)) == ("out", None)
    assert len(calls) == 1  # megatron's forward, once: no second dispatch of the same tokens
    counts = stats.counts()
    assert (counts["upstream_calls"], counts["pipelined_calls"], counts["chunks"]) == (1, 0, 0)
    effects, report = plugin.titan_effects(), plugin.titan_report()
    if composes:
        assert effects["composes_with"] == option and effects["upstream_calls"] == 1, effects
        assert "stepped_aside" not in effects and "api_dispatches" in effects, effects
        assert report["active"] is True and option in report["composes_with"], report
        assert "chunk pipeline stands aside" in report["composes_with"], report
    else:
        assert effects == {"stepped_aside": option, "layer_calls": 1, "upstream_calls": 1}
        assert report["active"] is False and option in report["inactive_reason"], report
        assert "--moe-flex-dispatcher-backend deepep" in report["inactive_reason"], report


def test_the_plugin_s_own_path_and_other_dispatchers_defer_to_nothing() -> None:
    assert upstream_paths.for_config(_flex_layer().config) is None  # flex + deepep: ours
    alltoall = _flex_layer(moe_token_dispatcher_type="alltoall",
                           overlap_moe_expert_parallel_comm=True).config  # fmt: skip
    assert upstream_paths.for_config(alltoall) is None  # the plugin does not serve alltoall


def test_a_layer_built_with_megatron_s_overlap_is_reported_before_any_forward(layout) -> None:  # type: ignore[no-untyped-def]
    """The combined-1F1B schedule never calls MoELayer.forward: the layer's construction tells."""
    layout(1, 2)
    built = []
    init = bindings.moe_layer_init(lambda self, config, *a, **k: built.append(config))
    config = _flex_layer(overlap_moe_expert_parallel_comm=True).config
    init(SimpleNamespace(), config, layer_number=1)
    assert built == [config]
    assert plugin.titan_effects()["composes_with"] == "overlap_moe_expert_parallel_comm"
    init(SimpleNamespace(), _flex_layer().config)  # a layer on the plugin's own path: nothing new
    assert [d.option for d in upstream_paths.seen()] == ["overlap_moe_expert_parallel_comm"]
