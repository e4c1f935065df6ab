"""The core's model of Megatron's schedule order against the order megatron-core really runs.

Real order: every ``schedules.forward_step`` / ``backward_step`` call on gloo workers, seen
through the core's ``titan_forward_microbatch`` / ``titan_backward_microbatch`` wrapper hooks.
A forward is labelled by its model chunk and megatron's own ``current_microbatch``; a backward by
the forward whose output it differentiates (tensor identity), so the test assumes nothing about
which microbatch a backward serves. Under EP A2A overlap megatron bypasses forward_step (combined
1F1B): there its ``combined_forward_backward_step`` is recorded the same way.
"""

from __future__ import annotations

from typing import Any

import pytest

from titan_plugins import hookimpl
from titan_plugins.hosts.megatron.schedule import (
    BACKWARD,
    COOLDOWN,
    FORWARD,
    INTERLEAVED,
    NO_PIPELINING,
    ONE_F_ONE_B,
    STEADY,
    WARMUP,
    Event,
    Unit,
    pipeline_schedule,
    schedule_kind,
    schedule_table,
)


def _first_tensor(value: Any) -> Any:
    while isinstance(value, list | tuple):
        value = value[0] if value else None
    return value


class OrderRecorder:
    """Records (kind, chunk, microbatch) per forward/backward this rank runs."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self.events: list[tuple[str, int, int]] = []
        self._outputs: dict[int, tuple[Any, tuple[int, int]]] = {}

    def forward(self, model: Any, microbatch: int) -> tuple[int, int]:
        chunk = next(i for i, c in enumerate(self.chunks) if c is model)
        self.events.append((FORWARD, chunk, microbatch))
        return chunk, microbatch

    def forward_output(self, output: Any, unit: tuple[int, int]) -> None:
        tensor = _first_tensor(output)
        self._outputs[id(tensor)] = (tensor, unit)

    def backward(self, output: Any) -> None:
        tensor = _first_tensor(output)
        kept, unit = self._outputs.pop(id(tensor))
        assert kept is tensor
        self.events.append((BACKWARD, *unit))

    def take(self) -> list[tuple[str, int, int]]:
        events, self.events = self.events, []
        self._outputs.clear()  # a forward-only pass leaves its outputs behind
        return events

    @hookimpl(wrapper=True)
    def titan_forward_microbatch(self, call: Any) -> Any:
        unit = self.forward(call.model, call.arg("current_microbatch", 11))
        result = yield
        self.forward_output(result[0], unit)
        return result

    @hookimpl(wrapper=True)
    def titan_backward_microbatch(self, call: Any) -> Any:
        self.backward(call.output_tensor)
        return (yield)


def _record_combined(recorder: OrderRecorder) -> Any:
    """Wrap megatron's combined 1F1B step (EP overlap) to record its forward, then backward."""
    from megatron.core.pipeline_parallel import combined_1f1b

    original = combined_1f1b.combined_forward_backward_step

    def step(func, iterator, f_model, n, input_tensor, store, b_model, b_in, b_out, *a, **kw):
        unit = recorder.forward(f_model, kw["current_microbatch"]) if f_model else None
        if b_model is not None:
            recorder.backward(b_out)
        result = original(
            func, iterator, f_model, n, input_tensor, store, b_model, b_in, b_out, *a, **kw
        )
        if unit is not None:
            recorder.forward_output(result[0], unit)
        return result

    combined_1f1b.combined_forward_backward_step = step
    return lambda: setattr(combined_1f1b, "combined_forward_backward_step", original)


def record_order(
    parallel: dict, counts: list[int], overrides: dict, evaluate: bool = False
) -> dict:
    """Worker task: the forward/backward order of one training step per microbatch count
    (and of one forward-only pass with ``evaluate``) on this rank."""
    from megatron.core import parallel_state as ps

    from titan_plugins import activation
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel(**parallel)
    cfg = tiny_gpt.make_config(**overrides)
    chunks = tiny_gpt.build_model(cfg)
    recorder = OrderRecorder(chunks)
    restore = _record_combined(recorder) if cfg.overlap_moe_expert_parallel_comm else None
    state = activation.Activation("test.schedule", entry_points=[]).start()
    state.manager.register(recorder, name="order")
    runs: dict = {}
    try:
        with activation.use(state):
            for count in counts:
                tiny_gpt.train(chunks, cfg, 1, num_microbatches=count)
                runs[count] = recorder.take()
            if evaluate:
                tiny_gpt.evaluate(chunks, cfg, num_microbatches=counts[0])
                runs["eval"] = recorder.take()
    finally:
        state.stop()
        if restore is not None:
            restore()
    return {"rank": ps.get_pipeline_model_parallel_rank(), "runs": runs}


def _model(kind: str, pp: int, rank: int, count: int, chunks: int = 1, **kw: Any) -> list:
    schedule = pipeline_schedule(kind, pp, rank, count, chunks, **kw)
    return [(e.kind, e.unit.chunk, e.unit.microbatch) for e in schedule.events]


def _check(results: list[dict], kind: str, pp: int, chunks: int = 1, **kw: Any) -> None:
    for result in results:
        rank = result["rank"]
        for count, real in result["runs"].items():
            if count == "eval":
                count = min(c for c in result["runs"] if c != "eval")
                expected = _model(kind, pp, rank, count, chunks, forward_only=True, **kw)
            else:
                expected = _model(kind, pp, rank, count, chunks, **kw)
            assert real == expected, (kind, pp, rank, count, kw)


def test_model_matches_megatron_1f1b_pp2(gloo_pool2) -> None:
    results = gloo_pool2.run(record_order, {"pp": 2}, [1, 2, 5], {}, True, timeout=240)
    _check(results, ONE_F_ONE_B, 2)


def test_model_matches_megatron_1f1b_pp4(gloo_pool4) -> None:
    results = gloo_pool4.run(record_order, {"pp": 4}, [3, 6], {"num_layers": 4}, timeout=240)
    _check(results, ONE_F_ONE_B, 4)


def test_model_matches_megatron_interleaved_pp2_vpp2(gloo_pool2) -> None:
    # unbatched P2P: PP=2 with batched P2P swaps tensors (order unaffected, numbers wrong)
    overrides = {"batch_p2p_comm": False}
    layout = {"pp": 2, "vpp": 2}
    results = gloo_pool2.run(record_order, layout, [2, 4, 6], overrides, True, timeout=240)
    _check(results, INTERLEAVED, 2, 2)
    # megatron's microbatch groups (0.16-0.19): 6 microbatches in groups of 3 (not PP) per chunk
    grouped = {**overrides, "microbatch_group_size_per_vp_stage": 3}
    results = gloo_pool2.run(record_order, layout, [6], grouped, timeout=240)
    _check(results, INTERLEAVED, 2, 2, group_size=3)
    assert results[0]["runs"][6][:6] == [(FORWARD, 0, 0), (FORWARD, 0, 1), (FORWARD, 0, 2)] + [
        (FORWARD, 1, 0),
        (FORWARD, 1, 1),
        (FORWARD, 1, 2),
    ]


def test_model_matches_megatron_ep_overlap_no_pipelining(gloo_pool2) -> None:
    """EP A2A overlap at PP=1: megatron's combined 1F1B runs the next forward with each backward."""
    overrides = {"bf16": True, "overlap_moe_expert_parallel_comm": True}
    results = gloo_pool2.run(record_order, {"ep": 2}, [1, 3], overrides, timeout=240)
    _check(results, NO_PIPELINING, 1, ep_overlap=True)
    assert results[0]["runs"][3][:3] == [(FORWARD, 0, 0), (FORWARD, 0, 1), (BACKWARD, 0, 0)]


def test_model_matches_megatron_ep_overlap_interleaved(gloo_pool4) -> None:
    """EP A2A overlap under PP2 x VPP2 (x EP2): one more warm-up forward, then combined steps."""
    overrides = {"bf16": True, "overlap_moe_expert_parallel_comm": True, "batch_p2p_comm": False}
    layout = {"pp": 2, "vpp": 2, "ep": 2}
    results = gloo_pool4.run(record_order, layout, [4], overrides, timeout=240)
    _check(results, INTERLEAVED, 2, 2, ep_overlap=True)
    first = next(r for r in results if r["rank"] == 0)["runs"][4]
    # 2 (pp - 1) + (vpp - 1) pp = 4 warm-up forwards, +1 for the overlap, then F/B pairs
    assert [kind for kind, _, _ in first[:7]] == [FORWARD] * 6 + [BACKWARD]


# ------------------------------------------------------------------------ the model on its own
def _text(schedule: Any) -> str:
    return " ".join(f"{e.kind}{e.unit.chunk}{e.unit.microbatch}" for e in schedule.events)


def test_orders_and_phases_by_hand() -> None:
    """Hand-written from schedules.py's loops (the recorded tests above check them for real)."""
    first = pipeline_schedule(ONE_F_ONE_B, 2, 0, 4)
    assert _text(first) == "F00 F01 B00 F02 B01 F03 B02 B03"
    assert (first.warmup, first.steady) == (1, 3)
    phases = [first.phase(i) for i in range(len(first.events))]
    assert phases == [WARMUP] + [STEADY] * 6 + [COOLDOWN]
    assert [first.gap(Unit(0, m)) for m in range(4)] == [1, 2, 2, 1]
    assert _text(pipeline_schedule(ONE_F_ONE_B, 8, 0, 3)) == "F00 F01 F02 B00 B01 B02"
    # PP2 VPP2, 4 microbatches: table (mb, chunk) 00 10 01 11 20 30 21 31; backward mirrors chunks
    inter = pipeline_schedule(INTERLEAVED, 2, 0, 4, 2)
    assert _text(inter) == "F00 F01 F10 F11 F02 B10 F03 B11 F12 B00 F13 B01 B12 B13 B02 B03"
    assert inter.warmup == 4 and inter.in_flight_peak() == 5 and inter.in_flight_peak(1) == 2
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)] + [
        (3, 0),
        (4, 0),
        (3, 1),
        (4, 1),
    ]
    evaluation = pipeline_schedule(INTERLEAVED, 2, 1, 4, 2, forward_only=True)
    assert {e.kind for e in evaluation.events} == {FORWARD} and evaluation.steady == 0


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_in_flight_is_pp_minus_rank(pp: int) -> None:
    for rank in range(pp):
        schedule = pipeline_schedule(ONE_F_ONE_B, pp, rank, 8)
        assert schedule.in_flight_peak() == min(pp - rank, 8)
        assert schedule.warmup == pp - rank - 1


def test_interleaved_warmup_counts() -> None:
    # 2 (pp - rank - 1) + (chunks - 1) group (+1 with EP overlap), capped at the unit count
    assert [pipeline_schedule(INTERLEAVED, 4, r, 8, 2).warmup for r in range(4)] == [10, 8, 6, 4]
    grouped = [pipeline_schedule(INTERLEAVED, 4, r, 8, 2, 8).warmup for r in range(4)]
    assert grouped == [14, 12, 10, 8]
    overlap = pipeline_schedule(INTERLEAVED, 4, 0, 8, 2, ep_overlap=True)
    assert overlap.warmup == 11 and overlap.in_flight_peak() == 12
    assert pipeline_schedule(INTERLEAVED, 4, 0, 4, 3).warmup == 12  # every unit in warm-up


def test_kinds_and_refusals() -> None:
    assert [schedule_kind(1), schedule_kind(4), schedule_kind(4, 2)] == [
        NO_PIPELINING,
        ONE_F_ONE_B,
        INTERLEAVED,
    ]
    for bad, match in (
        (lambda: pipeline_schedule("zero_bubble", 2, 0, 4), "kind"),
        (lambda: pipeline_schedule(ONE_F_ONE_B, 2, 2, 4), "outside"),
        (lambda: pipeline_schedule(ONE_F_ONE_B, 2, 0, 0), "num_microbatches"),
        (lambda: pipeline_schedule(ONE_F_ONE_B, 2, 0, 4, 2), "one model chunk"),
        (lambda: pipeline_schedule(ONE_F_ONE_B, 2, 0, 4, ep_overlap=True), "interleaved"),
        (lambda: pipeline_schedule(INTERLEAVED, 4, 0, 2, 2), r"\[PP=4, microbatches=2\]"),
        (lambda: pipeline_schedule(INTERLEAVED, 4, 0, 6, 2), "last group of 2"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()
    assert Event(FORWARD, Unit(0, 1)) == ("F", (0, 1))
