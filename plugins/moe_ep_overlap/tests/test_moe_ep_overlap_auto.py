"""The automatic serial-vs-pipeline choice (``autochunk``): on a fake clock, the rule and its
schedule; on gloo (EP=2), that every rank takes the same decisions on a real megatron MoE layer
(they must: both issue the same collectives) and that the results stay those of the fixed paths.
"""

from __future__ import annotations

import os

import pytest
import torch
from titan_moe_ep_overlap import autochunk, stats
from titan_moe_ep_overlap.autochunk import FIRST_PERIOD, TRIALS, WARMUP, ChunkChooser

EPS32 = torch.finfo(torch.float32).eps


class FakeClock:
    """A timer whose time only moves when the test says how long a call took."""

    def __init__(self) -> None:
        self.now = 0.0

    def start(self) -> float:
        return self.now

    def stop(self, started: float) -> float:
        return self.now - started


def _run(chooser: ChunkChooser, clock: FakeClock, cost: dict[int, float], calls: int) -> list:
    """``calls`` forward calls whose duration is ``cost[chunk count]``; the counts used."""
    used = []
    for _ in range(calls):
        count = chooser.begin()
        clock.now += cost[count]
        chooser.end()
        used.append(count)
    return used


def _single_rank(values: list[float]) -> list[float]:
    return list(values)


def test_first_window_alternates_then_keeps_the_faster_pipeline() -> None:
    stats.reset()
    clock = FakeClock()
    chooser = ChunkChooser(4, _single_rank, clock)
    window = 2 * (WARMUP + TRIALS)
    used = _run(chooser, clock, {1: 1.0, 4: 0.95}, window + FIRST_PERIOD)
    assert used[:window] == [4, 1] * (WARMUP + TRIALS)  # both paths, alternating
    assert used[window:] == [4] * FIRST_PERIOD and chooser.pipelined
    # the next window re-measures (no warm-up), confirms, and the steady period doubles
    used = _run(chooser, clock, {1: 1.0, 4: 0.95}, 2 * TRIALS + 1)
    assert used == [4, 1] * TRIALS + [4] and chooser.period == 2 * FIRST_PERIOD
    assert stats.snapshot()["auto_kept_pipeline"] == 2


@pytest.mark.parametrize("ratio", [1.10, 1.0, 0.99])  # slower, equal, within the 2% margin
def test_serial_is_kept_unless_the_pipeline_clearly_wins(ratio: float) -> None:
    stats.reset()
    clock = FakeClock()
    chooser = ChunkChooser(4, _single_rank, clock)
    used = _run(chooser, clock, {1: 1.0, 4: ratio}, 2 * (WARMUP + TRIALS) + FIRST_PERIOD)
    assert used[-FIRST_PERIOD:] == [1] * FIRST_PERIOD and not chooser.pipelined
    assert stats.snapshot()["auto_chose_serial"] == 1


def test_a_change_of_conditions_is_picked_up_and_resets_the_period() -> None:
    clock = FakeClock()
    chooser = ChunkChooser(2, _single_rank, clock)
    _run(chooser, clock, {1: 1.0, 2: 0.95}, 2 * (WARMUP + TRIALS) + FIRST_PERIOD)
    _run(chooser, clock, {1: 1.0, 2: 0.95}, 2 * TRIALS + 2 * FIRST_PERIOD)  # period doubled
    assert chooser.pipelined and chooser.period == 2 * FIRST_PERIOD
    used = _run(chooser, clock, {1: 1.0, 2: 1.01}, 2 * TRIALS + FIRST_PERIOD)  # link got fast
    assert not chooser.pipelined and chooser.period == FIRST_PERIOD
    assert used[-FIRST_PERIOD:] == [1] * FIRST_PERIOD


@pytest.mark.parametrize("ratio", [0.5, 0.8, 1.3, 2.0])
def test_re_measuring_costs_at_most_one_percent(ratio: float) -> None:
    """The steady period after a decision is long enough that the next window's calls of the
    slower path add <= 1% to the period's time (until the period cap, 1024 calls)."""
    clock = FakeClock()
    chooser = ChunkChooser(4, _single_rank, clock)
    cost = {1: 1.0, 4: ratio}
    _run(chooser, clock, cost, 2 * (WARMUP + TRIALS) + 1)
    chosen, other = (4, 1) if chooser.pipelined else (1, 4)
    steady = chooser.period * cost[chosen]
    wasted = TRIALS * (cost[other] - cost[chosen])
    assert chooser.pipelined == (ratio < 1)
    assert wasted <= autochunk.TRIAL_BUDGET * steady + 1e-9 or chooser.period == 1024


def test_ranks_decide_on_the_averaged_ratios() -> None:
    """Rank A alone would keep the pipeline (ratio 0.9), rank B would not (1.2); both apply the
    rule to the average over the ranks (the all_reduce), so both choose the same path."""
    local = {"a": {1: 1.0, 3: 0.9}, "b": {1: 1.0, 3: 1.2}}
    seen: dict[str, list[float]] = {}

    def agree_as(me: str, other: str):
        def agree(values: list[float]) -> list[float]:
            seen[me] = values
            ratio = local[other][3] / local[other][1]
            theirs = [ratio, float(ratio < 1), 1.0]
            return [v + w for v, w in zip(values, theirs)]

        return agree

    decisions = {}
    for me, other in (("a", "b"), ("b", "a")):
        clock = FakeClock()
        chooser = ChunkChooser(3, agree_as(me, other), clock)
        _run(chooser, clock, local[me], 2 * (WARMUP + TRIALS) + 1)
        decisions[me] = chooser.pipelined
    assert seen["a"] == pytest.approx([0.9, 1.0, 1.0]) and decisions == {"a": False, "b": False}


def test_pairs_cancel_a_load_drift() -> None:
    """The machine slows down up to 5x during the window (both calls of a pair alike); the
    pipeline is 10% faster within every pair: the decision sees it."""
    clock = FakeClock()
    chooser = ChunkChooser(4, _single_rank, clock)
    slow = iter([1.0] * 2 * WARMUP + [1.0 + i for i in range(TRIALS) for _ in (0, 1)])
    for _ in range(2 * (WARMUP + TRIALS)):
        count = chooser.begin()
        clock.now += next(slow) * (0.9 if count == 4 else 1.0)
        chooser.end()
    chooser.begin()
    assert chooser.pipelined and chooser.decisions == 1


def test_a_spike_does_not_buy_the_pipeline() -> None:
    """The pipeline costs 5%, but load spikes hit the serial call of half the pairs: the median
    ratio passes (0.7), yet the pipeline lost the other pairs, so serial is kept."""
    clock = FakeClock()
    chooser = ChunkChooser(4, _single_rank, clock)
    half = TRIALS // 2
    serial = iter([1.0] * WARMUP + [3.0] * half + [1.0] * (TRIALS - half))
    for _ in range(2 * (WARMUP + TRIALS)):
        count = chooser.begin()
        clock.now += 1.05 if count == 4 else next(serial)
        chooser.end()
    chooser.begin()
    assert not chooser.pipelined and chooser.decisions == 1


def test_device_samples_are_read_from_events() -> None:
    class Event:
        def __init__(self, t: float) -> None:
            self.t, self.synced = t, False

        def synchronize(self) -> None:
            self.synced = True

        def elapsed_time(self, end: Event) -> float:
            return (end.t - self.t) * 1e3  # milliseconds, like torch.cuda.Event

    start, end = Event(1.0), Event(1.25)
    assert autochunk._seconds((start, end)) == pytest.approx(0.25) and end.synced
    assert autochunk._seconds(0.5) == 0.5


# ------------------------------------------------------------------ real layer, two ranks
def task_auto_layer(calls: int, seed: int) -> dict:
    """A flex MoE layer called ``calls`` times with AUTO on (4 chunks configured) and, for each
    call, the same input through the fixed serial path: decisions, counters, max differences."""
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=2)
    env = {"TITAN_MOE_EP_OVERLAP_BACKEND": "torch", "TITAN_MOE_EP_OVERLAP_AUTO": "1"}
    diffs = []
    with plugin_active("moe_ep_overlap", env=env):
        cfg = tiny_gpt.make_config(num_layers=1, moe_token_dispatcher_type="flex",
                                   moe_router_dtype="fp32", num_moe_experts=4)  # fmt: skip
        mlp = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts).submodules.mlp
        # a ModuleSpec up to 0.17, a builder (functools.partial of MoELayer) from 0.18
        layer = build_module(mlp, config=cfg) if isinstance(mlp, ModuleSpec) else mlp(config=cfg)
        for p in layer.router.parameters():
            dist.broadcast(p.data, 0)
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        stats.reset()
        for _ in range(calls):
            x = torch.randn(64, 2, 64, generator=gen)
            os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = "4"
            auto_out, _ = layer(x)
            os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = "1"
            serial_out, _ = layer(x)
            diffs.append(((auto_out - serial_out).abs().max() / serial_out.abs().max()).item())
        effects = stats.snapshot()
        chooser = autochunk._choosers.get(layer)
    return {"effects": effects, "diffs": diffs, "pipelined": chooser.pipelined}


@pytest.mark.multiprocess
def test_ranks_agree_on_a_real_layer(gloo_pool2) -> None:
    calls = 2 * (WARMUP + TRIALS) + 4
    results = gloo_pool2.run(task_auto_layer, calls, 7)
    a, b = (res["effects"] for res in results)
    for key in ("pipelined_calls", "serial_calls", "chunks", "auto_decisions",
                "auto_kept_pipeline"):  # fmt: skip
        assert a[key] == b[key], (key, a, b)
    assert results[0]["pipelined"] == results[1]["pipelined"]
    assert a["auto_decisions"] == 1 and a["layer_calls"] == 2 * calls
    # every auto call ran one of the two paths; the trial window ran both
    assert a["pipelined_calls"] + a["serial_calls"] == 2 * calls and a["pipelined_calls"] >= 4
    # same math as the serial path; rounding differs only with other GEMM row counts
    assert all(diff <= 16 * EPS32 for res in results for diff in res["diffs"]), results
