"""Real path: the tiny MoE GPT trains through megatron-core's own schedules and optimizers on gloo
workers with rewind on; faults are injected and the rollback is checked against reference runs.

- NaN in one microbatch at PP=2 x EP=2 (bf16, no loss scaler: the NaN update is applied, then
  rolled back; dropout on, so the RNG restore matters; MoE expert bias on, so the non-parameter
  buffers matter): the final parameters and optimizer state are bit-identical to a run with the
  plugin off that trained up to the snapshot and skipped the same batches (the snapshot's state
  is that run's own state, so no restore code of ours is in the reference). The same at EP=2 x
  DP=2 with megatron's distributed optimizer (sharded fp32 main params).
- A loss spike (scrambled labels, loss x3) at PP=2 and a grad-norm spike (loss scaled x30 in the
  backward only) at EP=2: rewound at that step on every rank, including ranks without a loss.
- Repeated NaNs: a rewind, an escalated rewind that drops more batches, then RewindError.
- A NaN at step 0, 1 or 3 with the default knobs rolls back to the starting state (the model
  and optimizer as loaded, no Adam state yet): bit-identical to a plugin-off run that skipped
  those steps' batches; the same at step 1 with the distributed optimizer.
- Nothing to roll back to on one rank (over its host budget): every rank raises RewindError in
  the same step, the full message (step, reason, knobs) on rank 0 only.
- The demo's loop (``tiny_gpt.train``): an escalation really drops the batches it reports.
- 200 clean steps with the default knobs: no trigger.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from titan_plugins.errors import JobStopped
from titan_plugins.hosts.megatron.testing import tiny_gpt
from titan_plugins.testing import plugin_active

pytestmark = pytest.mark.multiprocess

NMB = 2  # microbatches per step


class Stream:
    """Endless microbatches: step ``i`` reads ``fixed_batches(NMB, seed=1000 + i)``; ``faults``
    maps a step to ``"loss"`` (scrambled labels, loss x3) or ``"grad"`` (backward loss x30)."""

    def __init__(self, faults: dict[int, str] | None = None) -> None:
        self.faults = faults or {}
        self.consumed = 0

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> dict[str, Any]:
        step, index = divmod(self.consumed, NMB)
        self.consumed += 1
        batch: dict[str, Any] = dict(tiny_gpt.fixed_batches(NMB, seed=1000 + step)[index])
        batch["loss_scale"] = batch["report_scale"] = 1.0
        fault = self.faults.get(step)
        if fault == "loss":
            generator = torch.Generator().manual_seed(step)
            batch["labels"] = torch.randint(
                0, tiny_gpt.VOCAB, (tiny_gpt.MBS, tiny_gpt.SEQ), generator=generator
            )
            batch["loss_scale"] = batch["report_scale"] = 3.0
        elif fault == "grad":
            batch["loss_scale"] = 30.0
        return batch


def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    """tiny_gpt's forward step with the Stream's loss scales."""
    batch = next(data_iterator)

    def loss_func(output_tensor: torch.Tensor) -> tuple:
        mask = batch["loss_mask"].view(-1).float()
        loss = torch.sum(output_tensor.view(-1).float() * mask)
        num_tokens = mask.sum().to(torch.int)
        report = torch.stack([loss.detach() * batch["report_scale"], num_tokens.float()])
        return loss * batch["loss_scale"], num_tokens, {"lm loss": report}

    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


def build(parallel: dict, distributed: bool = False, **overrides: Any) -> tuple[list, Any]:
    """Model chunks and megatron optimizer for ``parallel``, from the same seeds every time;
    ``distributed``: megatron's distributed optimizer (fp32 main shards over DP)."""
    from megatron.core.distributed import finalize_model_grads

    tiny_gpt.init_parallel(**parallel)
    torch.manual_seed(4321)  # the CPU generator feeds dropout: same start in every run
    cfg = tiny_gpt.make_config(**overrides)
    cfg.finalize_model_grads_func = finalize_model_grads
    if not distributed:
        chunks = tiny_gpt.build_model(cfg)
        return chunks, tiny_gpt.make_optimizer(chunks, cfg)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    chunks = [
        DistributedDataParallel(cfg, ddp_config, Float16Module(cfg, chunk))
        for chunk in tiny_gpt.build_model(cfg, ddp=False)
    ]
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        bf16=True,
        params_dtype=cfg.params_dtype,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    return chunks, get_megatron_optimizer(config, chunks)


def run_steps(chunks: list, optimizer: Any, data: Stream, steps: int) -> None:
    """``steps`` iterations of megatron's schedule + optimizer on one persistent iterator."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    for _ in range(steps):
        clear_aux_losses_tracker()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=chunks[0],
            num_microbatches=NMB,
            seq_length=tiny_gpt.SEQ,
            micro_batch_size=tiny_gpt.MBS,
            forward_only=False,
        )
        optimizer.step()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state dict under a path name."""
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}.{key}").items()
        }
    if isinstance(value, list | tuple):
        return {
            k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}[{i}]").items()
        }
    return {prefix: value}


def final_state(chunks: list, optimizer: Any) -> dict[str, Any]:
    """Parameters, buffers (expert bias), megatron's optimizer state dict, and each torch
    optimizer's own state and params (the fp32 masters; the distributed optimizer's state dict
    leaves its sharded state out), flattened."""
    state = {f"param.{k}": v for k, v in tiny_gpt.global_state_dict(chunks).items()}
    for index, chunk in enumerate(chunks):
        for name, buffer in chunk.named_buffers():
            state[f"buffer{index}.{name}"] = buffer.detach().clone()
    state.update(flatten(optimizer.state_dict(), "optimizer"))
    for number, leaf in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = leaf.optimizer
        state.update(flatten(inner.state_dict(), f"torch{number}"))
        for group, params in enumerate(g["params"] for g in inner.param_groups):
            for position, param in enumerate(params):
                state[f"torch{number}.main{group}.{position}"] = param.detach().clone()
    return state


def differences(left: dict[str, Any], right: dict[str, Any]) -> list[str]:
    """Names whose values are not bit-identical (same dtype, same bits)."""
    out = sorted(set(left) ^ set(right))
    for key in set(left) & set(right):
        a, b = left[key], right[key]
        if isinstance(a, torch.Tensor):
            same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        else:
            same = a == b
        if not same:
            out.append(key)
    return out


def _effect() -> dict[str, Any]:
    import titan_rewind

    return titan_rewind.effect()


# ------------------------------------------------------------------------------ NaN, PP2 x EP2
NAN_STEP, STEPS = 5, 8
NAN_ENV = {
    "TITAN_REWIND_INTERVAL": "2",
    "TITAN_REWIND_STABLE_AFTER": "1",
    "TITAN_REWIND_INJECT_NAN_STEP": str(NAN_STEP),
}
# Snapshots after steps 0, 2 (stable after step 3) and 4 (pending): the NaN at step 5 restores
# step 2's, and the batches of steps 3, 4 and 5 are skipped.
RESTORED, SKIPPED = 2, 3
NAN_MODEL = dict(
    bf16=True,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    moe_router_enable_expert_bias=True,
    moe_router_score_function="sigmoid",
)


def nan_task(parallel: dict, distributed: bool = False) -> dict[str, Any]:
    """Rewind run vs reference run on this rank; returns what the test checks."""
    from megatron.core import parallel_state as ps
    from titan_rewind import inject

    chunks, optimizer = build(parallel, distributed, **NAN_MODEL)
    data = Stream()
    with plugin_active("rewind", NAN_ENV):
        run_steps(chunks, optimizer, data, STEPS)
        effect = _effect()
        fired = sorted(inject.fired())
    rewound = final_state(chunks, optimizer)
    optimizers = sorted({type(o).__name__ for o in optimizer.chained_optimizers})

    chunks, optimizer = build(parallel, distributed, **NAN_MODEL)
    reference_data = Stream()
    run_steps(chunks, optimizer, reference_data, RESTORED + 1)
    for _ in range(SKIPPED * NMB):  # the skipped batches
        next(reference_data)
    run_steps(chunks, optimizer, reference_data, STEPS - NAN_STEP - 1)
    reference = final_state(chunks, optimizer)
    return {
        "differences": differences(rewound, reference),
        "compared": len(reference),
        "finite": all(torch.isfinite(v).all() for k, v in rewound.items() if k.startswith("param")),
        "events": effect["events"],
        "fired": fired,
        "last_stage": ps.is_pipeline_last_stage(),
        "consumed": (data.consumed, reference_data.consumed),
        "has_expert_bias": any("expert_bias" in k for k in rewound),
        "optimizers": optimizers,
    }


@pytest.fixture(scope="module")
def nan_results(gloo_pool4):
    return gloo_pool4.run(nan_task, {"pp": 2, "ep": 2}, timeout=600)


def _check_bit_identical(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["differences"] == [], f"rank {rank}: {result['differences'][:10]}"
        assert result["compared"] > 50 and result["has_expert_bias"]
        assert result["finite"]
        # The data iterator stayed where it was: the same batches were read in both runs.
        assert result["consumed"] == (STEPS * NMB, STEPS * NMB)


def test_nan_rewind_is_bit_identical_to_the_skipping_reference(nan_results):
    _check_bit_identical(nan_results)
    assert nan_results[0]["optimizers"] == ["Float16OptimizerWithFloat16Params"]


def test_nan_rewind_with_the_distributed_optimizer(gloo_pool2):
    """EP=2 x DP=2, fp32 main params sharded over DP: each rank restores its own shards."""
    results = gloo_pool2.run(nan_task, {"ep": 2}, True, timeout=600)
    _check_bit_identical(results)
    assert results[0]["optimizers"] == ["DistributedOptimizer"]
    assert [len(r["events"]) for r in results] == [1, 1]


def test_nan_rewind_is_one_collective_decision(nan_results):
    expected = {
        "step": NAN_STEP,
        "trigger": "nonfinite_loss",
        "snapshot_step": RESTORED,
        "steps_skipped": SKIPPED,
        "microbatches_skipped": SKIPPED * NMB,
        "extra_microbatches_dropped": 0,
        "level": 1,
    }
    for result in nan_results:
        (event,) = result["events"]
        assert {k: event[k] for k in expected} == expected
        # Only the last stage computes a loss: the NaN was injected there, and seen everywhere.
        assert result["fired"] == ([NAN_STEP] if result["last_stage"] else [])


# ------------------------------------------------------------------------------ spikes, 2 ranks
SPIKE_STEP, SPIKE_STEPS = 8, 11
SPIKE_ENV = {
    "TITAN_REWIND_INTERVAL": "2",
    "TITAN_REWIND_STABLE_AFTER": "2",
    "TITAN_REWIND_LOSS_MIN_HISTORY": "5",
    "TITAN_REWIND_GRAD_MIN_HISTORY": "5",
}
# Snapshots after steps 0, 2, 4, 6, each stable two healthy steps later: at step 8 the stable
# one is step 4's (step 6's has one healthy step after it).
SPIKE_RESTORED = 4


def spike_task(kind: str) -> dict[str, Any]:
    """``kind`` "loss" at PP=2 (the first stage has no loss), "grad" at EP=2 (DP=2)."""
    from megatron.core import parallel_state as ps

    chunks, optimizer = build({"pp": 2} if kind == "loss" else {"ep": 2})
    data = Stream({SPIKE_STEP: kind})
    with plugin_active("rewind", SPIKE_ENV):
        run_steps(chunks, optimizer, data, SPIKE_STEPS)
        effect = _effect()
    return {"events": effect["events"], "has_loss": ps.is_pipeline_last_stage()}


@pytest.fixture(scope="module")
def spike_results(gloo_pool2):
    return {kind: gloo_pool2.run(spike_task, kind, timeout=600) for kind in ("loss", "grad")}


@pytest.mark.parametrize(("kind", "trigger"), [("loss", "loss_spike"), ("grad", "grad_norm_spike")])
def test_spike_rewinds_at_its_step_on_every_rank(spike_results, kind, trigger):
    results = spike_results[kind]
    for result in results:
        (event,) = result["events"]
        assert (event["step"], event["trigger"], event["snapshot_step"]) == (
            SPIKE_STEP,
            trigger,
            SPIKE_RESTORED,
        )
        assert event["value"] > event["threshold"]
    # The same decision on both ranks (only the restore's duration is each rank's own).
    same = [{k: v for k, v in r["events"][0].items() if k != "seconds"} for r in results]
    assert same[0] == same[1]
    if kind == "loss":
        assert [r["has_loss"] for r in results] == [False, True]


# ------------------------------------------------------------------------------ escalation, 1 rank
ESCALATE_ENV = {
    "TITAN_REWIND_INTERVAL": "2",
    "TITAN_REWIND_STABLE_AFTER": "1",
    "TITAN_REWIND_INJECT_NAN_STEP": "4,6,8",
    "TITAN_REWIND_ESCALATE_WINDOW": "3",
    "TITAN_REWIND_ESCALATE_SKIP": "2",
    "TITAN_REWIND_MAX_REWINDS": "2",
}


def escalate_task() -> dict[str, Any]:
    """NaNs at steps 4, 6 and 8, each within 3 steps of the previous rewind."""
    from titan_rewind import RewindError

    from titan_plugins import active_manager

    chunks, optimizer = build({})
    data = Stream()
    error = ""
    with plugin_active("rewind", ESCALATE_ENV):
        try:
            run_steps(chunks, optimizer, data, 12)
        except RewindError as err:
            error = str(err)
        effect = _effect()
        (effects,) = [
            impl.function()
            for impl in active_manager().hook.titan_effects.get_hookimpls()
            if impl.plugin_name == "rewind"
        ]
    return {
        "error": error,
        "events": effect["events"],
        "consumed": data.consumed,
        "effects": effects,
    }


def test_repeated_faults_escalate_then_raise(gloo_pool1):
    (result,) = gloo_pool1.run(escalate_task, timeout=600)
    first, second = result["events"]
    # Snapshots after steps 0 and 2 (stable after step 3): both rewinds restore step 2's.
    assert (first["step"], first["level"], first["snapshot_step"]) == (4, 1, 2)
    assert first["extra_microbatches_dropped"] == 0
    assert first["value"] == "nan"  # non-finite values as text: reports stay strict JSON
    json.dumps(result["events"], allow_nan=False)
    # Level 2 also drops ESCALATE_SKIP (2) steps of batches from the data iterator.
    assert (second["step"], second["level"], second["snapshot_step"]) == (6, 2, 2)
    assert second["extra_microbatches_dropped"] == 2 * NMB
    assert "nonfinite_loss nan at step 8" in result["error"]
    # The message leads with the last 8 steps: the healthy ones, then the faults 4, 6, 8.
    head, *steps = result["error"].splitlines()[:9]
    assert head == "rewind: the last 8 step(s) before the stop (global loss, grad norm):"
    assert [line.split(":")[0] for line in steps] == [f"  step {i}" for i in range(1, 9)]
    assert [i for i, line in enumerate(steps, 1) if "(nonfinite_loss)" in line] == [4, 6, 8]
    assert "steps 4, 6, 8" in result["error"] and "TITAN_REWIND_MAX_REWINDS" in result["error"]
    # Steps 0..8 read their batches; escalation dropped 4 more.
    assert result["consumed"] == 9 * NMB + 2 * NMB
    effects = result["effects"]  # titan_effects: flat numbers for the demo's table
    assert {k: effects[k] for k in ("steps_checked", "rewinds", "last_rewind_step")} == {
        "steps_checked": 9,
        "rewinds": 2,
        "last_rewind_step": 6,
    }
    assert effects["microbatches_skipped"] == (2 + 4) * NMB
    assert effects["extra_microbatches_dropped"] == 2 * NMB and effects["host_bytes"] > 0


# ------------------------------------------------------------------------------ the starting state
START_STEPS = 6


def start_task(parallel: dict, distributed: bool, nan_steps: list[int]) -> list[dict[str, Any]]:
    """Default knobs, one NaN at each of ``nan_steps`` (one run each): rewound to the start,
    against the plugin-off run that skipped the batches of steps 0..NaN."""
    out = []
    for nan_step in nan_steps:
        chunks, optimizer = build(parallel, distributed, **NAN_MODEL)
        data = Stream()
        with plugin_active("rewind", {"TITAN_REWIND_INJECT_NAN_STEP": str(nan_step)}):
            run_steps(chunks, optimizer, data, START_STEPS)
            effect = _effect()
        rewound = final_state(chunks, optimizer)

        chunks, optimizer = build(parallel, distributed, **NAN_MODEL)
        reference_data = Stream()
        for _ in range((nan_step + 1) * NMB):  # the batches of steps 0..nan_step
            next(reference_data)
        run_steps(chunks, optimizer, reference_data, START_STEPS - nan_step - 1)
        reference = final_state(chunks, optimizer)
        out.append(
            {
                "nan_step": nan_step,
                "differences": differences(rewound, reference),
                "compared": len(reference),
                "events": effect["events"],
                "consumed": (data.consumed, reference_data.consumed),
            }
        )
    return out


def _check_start(results: list[list[dict[str, Any]]], nan_steps: list[int]) -> None:
    for rank, runs in enumerate(results):
        assert [r["nan_step"] for r in runs] == nan_steps
        for run in runs:
            nan_step = run["nan_step"]
            assert run["differences"] == [], (
                f"rank {rank}, NaN {nan_step}: {run['differences'][:10]}"
            )
            assert run["compared"] > 50
            assert run["consumed"] == (START_STEPS * NMB, START_STEPS * NMB)
            (event,) = run["events"]
            assert (event["step"], event["snapshot_step"], event["steps_skipped"]) == (
                nan_step,
                -1,
                nan_step + 1,
            )
            assert event["microbatches_skipped"] == (nan_step + 1) * NMB


def test_an_early_nan_rolls_back_to_the_starting_state_bit_identically(gloo_pool1):
    """bf16 with fp32 masters, dropout and MoE expert bias: the start's RNG and buffers are
    those before the first forward, its optimizer has no state yet (torch creates Adam's
    moments at the first update); the run then equals one that never saw those steps."""
    (runs,) = gloo_pool1.run(start_task, {}, False, [0, 1, 3], timeout=600)
    _check_start([runs], [0, 1, 3])


def test_an_early_nan_rolls_back_to_the_start_with_the_distributed_optimizer(gloo_pool2):
    results = gloo_pool2.run(start_task, {"ep": 2}, True, [1], timeout=600)
    _check_start(results, [1])


# ------------------------------------------------------------------------------ nothing to roll back
def no_target_task() -> dict[str, Any]:
    """DP=2, rank 1 over its host budget (so no snapshot at all there), NaN at step 1."""
    import torch.distributed as dist

    rank = dist.get_rank()
    env = {"TITAN_REWIND_INJECT_NAN_STEP": "1"}
    if rank == 1:
        env["TITAN_REWIND_MAX_HOST_BYTES"] = "1"
    chunks, optimizer = build({})
    data = Stream()
    try:
        with plugin_active("rewind", env):
            run_steps(chunks, optimizer, data, 4)
    except Exception as err:  # what a launcher sees, without importing titan_rewind
        return {
            "class": type(err).__name__,
            "marker": isinstance(err, JobStopped),
            "primary": err.primary,
            "message": str(err),
            "knobs": list(err.knobs),
            "step": err.step,
            "exit_code": err.exit_code,
            "consumed": data.consumed,
        }
    return {"class": None, "consumed": data.consumed}


def test_nothing_to_roll_back_on_one_rank_stops_every_rank_with_one_message(gloo_pool2):
    first, second = gloo_pool2.run(no_target_task, timeout=600)
    for result in (first, second):
        assert (result["class"], result["marker"], result["step"]) == ("RewindError", True, 1)
        assert result["exit_code"] != 0 and result["consumed"] == 2 * NMB  # same step on both
        assert result["knobs"] == ["TITAN_REWIND_MAX_HOST_BYTES"]
    # Rank 0 could roll back itself, but rank 1 cannot: nobody rolls back, and rank 0 says why.
    assert first["primary"] and not second["primary"]
    text = first["message"]
    # It leads with the last steps' global numbers, then says why the run stops.
    lines = text.splitlines()
    assert lines[0] == "rewind: the last 2 step(s) before the stop (global loss, grad norm):"
    assert lines[1].startswith("  step 0: loss 4.") and lines[2].startswith(
        "  step 1: loss nan/inf"
    )
    assert lines[2].endswith("(nonfinite_loss)")
    assert lines[3].startswith(
        "rewind: step 1: nonfinite_loss nan, and nothing to roll back to on 1 of 2"
    )
    assert "\n  rank(s) 1: two snapshots of this rank need " in text
    assert "with the Adam moments the first update creates" in text
    assert "over the rewind budget of 1 " in text
    assert text.endswith("knobs that would have helped: TITAN_REWIND_MAX_HOST_BYTES")
    assert "\n" not in second["message"] and "rank 0 raised" in second["message"]


# ------------------------------------------------------------------------------ the demo's loop
DEMO_FAULTS_ENV = {"TITAN_REWIND_INJECT_NAN_STEP": "1,2,3", "TITAN_REWIND_ESCALATE_SKIP": "3"}


def demo_escalate_task() -> dict[str, Any]:
    """``tiny_gpt.train`` (the CPU demo's loop), default knobs but ESCALATE_SKIP=3, NaNs at
    steps 1, 2, 3: rewind to the start, escalated rewind that drops 3 steps, RewindError."""
    from titan_rewind import RewindError

    made = []

    class Counted(tiny_gpt.RepeatingBatches):
        def __init__(self, batches: list) -> None:
            super().__init__(batches)
            made.append(self)

    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_config()
    chunks = tiny_gpt.build_model(cfg)
    original, tiny_gpt.RepeatingBatches = tiny_gpt.RepeatingBatches, Counted
    error = ""
    try:
        with plugin_active("rewind", DEMO_FAULTS_ENV):
            try:
                tiny_gpt.train(chunks, cfg, 8, num_microbatches=NMB)
            except RewindError as err:
                error = str(err)
            effect = _effect()
    finally:
        tiny_gpt.RepeatingBatches = original
    return {"error": error, "events": effect["events"], "consumed": [d.consumed for d in made]}


def test_the_escalation_drops_the_batches_it_reports_in_the_demos_loop(gloo_pool1):
    (result,) = gloo_pool1.run(demo_escalate_task, timeout=600)
    first, second = result["events"]
    assert (first["step"], first["level"], first["snapshot_step"]) == (1, 1, -1)
    assert (second["step"], second["level"], second["snapshot_step"]) == (2, 2, -1)
    assert second["extra_microbatches_dropped"] == second["extra_microbatches_wanted"] == 3 * NMB
    assert second["skip_problem"] is None
    # Counted: steps 0..3 read their microbatches, and the escalation 3 steps' more.
    assert result["consumed"] == [4 * NMB + 3 * NMB]
    assert "steps 1, 2, 3" in result["error"] and "TITAN_REWIND_ESCALATE_SKIP" in result["error"]
    assert "the starting state (before step 0)" in result["error"]


# ------------------------------------------------------------------------------ no false positive
def clean_task(steps: int) -> dict[str, Any]:
    """The demo's data (the same batches every step, so the loss falls steadily), 200 steps."""
    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_config()
    chunks = tiny_gpt.build_model(cfg)
    with plugin_active("rewind"):
        losses, norms = tiny_gpt.train(chunks, cfg, steps, num_microbatches=NMB)
        effect = _effect()
    return {"effect": effect, "losses": losses, "norms": norms}


def test_no_rewind_on_a_clean_run_with_default_knobs(gloo_pool1):
    (result,) = gloo_pool1.run(clean_task, 200, timeout=600)
    effect = result["effect"]
    assert effect["steps_checked"] == 200
    assert effect["rewinds"] == 0 and effect["unhandled_triggers"] == []
    # The starting state, after step 0, then every 10 healthy steps.
    assert effect["snapshots_taken"] == 21
    # The checks were armed (past warm-up) for most of the run.
    assert (
        effect["thresholds"]["loss"] is not None and effect["thresholds"]["grad_norm"] is not None
    )
    assert result["losses"][-1] < result["losses"][0] / 4
