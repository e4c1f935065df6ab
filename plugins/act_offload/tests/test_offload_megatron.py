"""Real path: the tiny MoE GPT trains through megatron-core's own schedules on gloo workers with
the plugin off and on; losses, grad norms and every gradient must be bit-identical, and the
device-resident saved-activation bytes must follow the plan.

Each task trains the same layout twice in the same workers (plugin off, then on) from the same
initial weights (``init_parallel`` reseeds), so any difference is the plugin's.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from titan_plugins.hosts.megatron.testing import tiny_gpt
from titan_plugins.testing import plugin_active

pytestmark = pytest.mark.multiprocess

STEPS = 2
BASE_ENV = {"TITAN_ACT_OFFLOAD_MIN_BYTES": "0"}  # the tiny model's tensors are a few KiB


def _grads(chunks: list) -> dict[str, torch.Tensor]:
    from titan_plugins.hosts.megatron.testing.model_state import named_global_parameters

    return {name: p.main_grad.detach().clone() for name, p in named_global_parameters(chunks)}


class _Collect(logging.Handler):
    """Keeps the plugin's log messages of one run."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(parallel: dict, overrides: dict, nmb: int) -> dict[str, Any]:
    if overrides.get("fine_grained_activation_offloading"):
        # megatron's offload manager is a process singleton: start each run from scratch (and
        # leave a fresh one to the next task in these shared workers).
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            PipelineOffloadManager,
        )

        PipelineOffloadManager.reset_instance()
    tiny_gpt.init_parallel(**parallel)
    cfg = tiny_gpt.make_config(**overrides)
    chunks = tiny_gpt.build_model(cfg)
    losses, grad_norms = tiny_gpt.train(chunks, cfg, STEPS, nmb)
    if overrides.get("fine_grained_activation_offloading"):
        PipelineOffloadManager.reset_instance()
    return {"losses": losses, "grad_norms": grad_norms, "grads": _grads(chunks)}


def offload_task(
    parallel: dict, overrides: dict, nmb: int, envs: dict[str, dict | None]
) -> dict[str, Any]:
    """Train once per entry of ``envs`` (None: plugin off); return results and offload stats."""
    from megatron.core import parallel_state as ps
    from titan_act_offload import runtime

    results: dict[str, Any] = {}
    for name, env in envs.items():
        if env is None:
            results[name] = _train(parallel, overrides, nmb)
            continue
        handler = _Collect()
        log = logging.getLogger("titan_plugins.act_offload")
        log.addHandler(handler)
        try:
            with plugin_active("act_offload", {**BASE_ENV, **env}) as engine:
                failed = [p.id for p in engine.patches() if p.status == "failed"]
                assert not failed, failed
                result = _train(parallel, overrides, nmb)
                rt = runtime.current()
                plan = rt.last_plan
                report, effects = rt.report(), rt.effects()
                # Absent when no schedule ran with the plugin (the offloader is built lazily).
                stats, host_pool = report.get("stats"), report.get("host_pool")
        finally:
            log.removeHandler(handler)
        result.update(stats=stats, host_pool=host_pool, effects=effects, warnings=handler.messages)
        if plan is None:  # the plugin stayed out of every schedule
            results[name] = result
            continue
        unit_bytes = stats["unit_bytes"]
        result.update(
            offloaded_units=sorted(tuple(u) for u in plan.offload),
            in_flight=plan.in_flight_peak(),
            kept_in_flight=plan.in_flight_peak(kept_only=True),
            plan_kept_peak=plan.resident_peak(unit_bytes),
            plan_all_peak=plan.resident_peak(unit_bytes, kept_only=False),
            plan_kept_by_chunk={
                c: plan.resident_peak(unit_bytes, chunk=c) for c in {u.chunk for u in plan.units()}
            },
        )
        results[name] = result
    results["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    return results


def assert_identical(off: dict, on: dict) -> None:
    """Bit-identical training: losses, grad norms and every gradient of the last step."""
    assert on["losses"] == off["losses"]
    assert on["grad_norms"] == off["grad_norms"]
    assert on["grads"].keys() == off["grads"].keys()
    for name, grad in off["grads"].items():
        assert torch.equal(on["grads"][name], grad), name


def transient_bound(run: dict) -> int:
    """Kept bytes plus what moves: an outer block (the MoE layer) held across its nested expert
    blocks, the block backward is reading, and the one prefetched ahead."""
    return run["plan_kept_peak"] + 3 * run["stats"]["max_block_bytes"]


def test_offload_pp1_every_microbatch_bit_identical(gloo_pool1):
    # PP=1 runs F0 B0 F1 B1: no microbatch waits, so the default plan offloads nothing; MIN_GAP=0
    # offloads every microbatch anyway (block by block within the forward/backward of each).
    envs = {
        "off": None,
        "on": {"TITAN_ACT_OFFLOAD_MIN_GAP": "0"},
        "default": {},
        "layer": {"TITAN_ACT_OFFLOAD_MIN_GAP": "0", "TITAN_ACT_OFFLOAD_MODULES": "layer,experts"},
    }
    (result,) = gloo_pool1.run(offload_task, {}, {}, 2, envs)
    for name in ("on", "default", "layer"):
        assert_identical(result["off"], result[name])
    # Whole layers (norms and residual inputs included) save more than attention + MLP blocks.
    layer = result["layer"]["stats"]
    assert layer["offloaded_bytes"] > result["on"]["stats"]["offloaded_bytes"]
    assert layer["late_reloads"] == 0 and layer["schedule_mismatches"] == 0
    on, default = result["on"]["stats"], result["default"]["stats"]
    assert default["offloaded_bytes"] == 0 and result["default"]["offloaded_units"] == []
    assert on["offloaded_bytes"] > 0 and on["schedule_mismatches"] == 0
    # Everything offloaded comes back ahead of use (plan head + one block ahead), never late.
    assert on["prefetched_bytes"] == on["offloaded_bytes"] and on["late_reloads"] == 0
    assert on["peak_kept"] == 0 and on["resident"] == 0
    # Never more than the block being staged/used plus the prefetched one on the device.
    assert on["peak_resident"] <= transient_bound(result["on"])
    assert on["peak_resident"] < default["peak_resident"]


def test_offload_pp2_1f1b_bit_identical_and_peak_as_planned(gloo_pool2):
    envs = {
        "off": None,
        "dry": {"TITAN_ACT_OFFLOAD_DRY_RUN": "1"},
        "gap2": {"TITAN_ACT_OFFLOAD_MIN_GAP": "2"},
        "on": {},
    }
    # deallocate_pipeline_outputs=True as megatron.training forces it (pseudo-frees sent outputs).
    overrides = {"num_layers": 4, "deallocate_pipeline_outputs": True}
    results = gloo_pool2.run(offload_task, {"pp": 2}, overrides, 4, envs)
    for result in results:
        for name in ("dry", "gap2", "on"):
            assert_identical(result["off"], result[name])
            assert result[name]["stats"]["schedule_mismatches"] == 0
        dry, gap2, on = (result[n] for n in ("dry", "gap2", "on"))
        # The dry run keeps everything: its measured peak is the schedule's in-flight peak.
        assert dry["stats"]["peak_resident"] == dry["plan_all_peak"]
        # Kept (never offloaded) bytes peak exactly where the plan says.
        for run in (gap2, on):
            assert run["stats"]["peak_kept"] == run["plan_kept_peak"]
            assert run["stats"]["peak_resident"] <= transient_bound(run)
        sizes = set(dry["stats"]["unit_bytes"].values())
        assert len(sizes) == 1  # every microbatch saves the same bytes
        if result["pp_rank"] == 0:
            # Stage 0 of 2 runs F0 F1 B0 F2 B1 F3 B2 B3: up to 2 microbatches in flight.
            # MIN_GAP=2 offloads microbatches 1 and 2 (2 events wait), keeps 0 and 3: 1 of 2.
            assert dry["in_flight"] == 2 and gap2["kept_in_flight"] == 1
            assert gap2["offloaded_units"] == [(0, 1), (0, 2)]
            assert gap2["stats"]["peak_kept"] / dry["stats"]["peak_resident"] == 0.5
            # The default (MIN_GAP=1) offloads all four: nothing stays, blocks come and go.
            assert on["offloaded_units"] == [(0, m) for m in range(4)]
            assert on["stats"]["peak_kept"] == 0
            assert on["stats"]["peak_resident"] < 0.5 * dry["stats"]["peak_resident"]
        else:
            # The last stage runs each backward right after its forward: nothing to offload.
            assert on["offloaded_units"] == [] and on["stats"]["offloaded_bytes"] == 0
            assert on["stats"]["peak_resident"] == dry["stats"]["peak_resident"]


def test_offload_pp2_vpp2_bit_identical_per_chunk_plan(gloo_pool2):
    # Batched P2P with PP=2 + VPP swaps tensors upstream (DESIGN 7): unbatched, no overlap.
    overrides = {"num_layers": 4, "batch_p2p_comm": False, "overlap_p2p_comm": False}
    envs = {"off": None, "dry": {"TITAN_ACT_OFFLOAD_DRY_RUN": "1"}, "on": {}}
    results = gloo_pool2.run(offload_task, {"pp": 2, "vpp": 2}, overrides, 4, envs)
    for result in results:
        dry, on = result["dry"], result["on"]
        assert_identical(result["off"], dry)
        assert_identical(result["off"], on)
        assert on["stats"]["schedule_mismatches"] == 0 and on["stats"]["late_reloads"] == 0
        assert dry["stats"]["peak_resident"] == dry["plan_all_peak"]
        assert on["stats"]["peak_kept"] == on["plan_kept_peak"]
        for chunk, kept in on["plan_kept_by_chunk"].items():
            assert on["stats"]["peak_kept_by_chunk"].get(chunk, 0) == kept
        assert on["stats"]["peak_resident"] <= transient_bound(on)
        # Interleaving keeps more units in flight than 1F1B (2 on stage 0): stage 0 runs
        # F00 F01 F10 F11 | F02 B10 | F03 B11 | F12 B00 | F13 B01 | B12 B13 B02 B03 (chunk,mb):
        # 5 in flight, each waits >= 1 step, all offloaded. On stage 1 the last virtual stage
        # (chunk 1) runs each backward right after its forward: those stay (1 of 3 in flight).
        if result["pp_rank"] == 0:
            assert dry["in_flight"] == 5 and on["kept_in_flight"] == 0
            assert len(on["offloaded_units"]) == 8
        else:
            assert dry["in_flight"] == 3 and on["kept_in_flight"] == 1
            assert on["offloaded_units"] == [(0, m) for m in range(4)]
        assert on["stats"]["peak_resident"] < 0.5 * dry["stats"]["peak_resident"]


def test_offload_pp2_ep2_bit_identical(gloo_pool4):
    envs = {"off": None, "on": {}}
    results = gloo_pool4.run(offload_task, {"pp": 2, "ep": 2}, {"num_layers": 4}, 4, envs)
    for result in results:
        assert_identical(result["off"], result["on"])
        stats = result["on"]["stats"]
        assert stats["schedule_mismatches"] == 0 and stats["late_reloads"] == 0
        if result["pp_rank"] == 0:
            assert stats["offloaded_bytes"] > 0 and stats["peak_kept"] == 0


def test_offload_composes_with_selective_recompute(gloo_pool1):
    # core_attn / moe use reentrant checkpointing (nothing saved in forward but the inputs;
    # recomputation inside backward is left alone); layernorm discards its output storage
    # (CheckpointWithoutOutput), which the "layer" block sees released and leaves to megatron.
    # ("layernorm" recompute needs TE in 0.16.1: CheckpointWithoutOutput reads
    # FP8GlobalStateManager; the output-discarding path is covered in test_offload_engine.)
    overrides = {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe"]}
    on = {"TITAN_ACT_OFFLOAD_MIN_GAP": "0"}
    (result,) = gloo_pool1.run(offload_task, {}, overrides, 2, {"off": None, "on": on})
    (plain,) = gloo_pool1.run(offload_task, {}, {}, 2, {"on": on})
    assert_identical(result["off"], result["on"])
    recompute, full = result["on"]["stats"], plain["on"]["stats"]
    # Recomputed regions save only their inputs: less to offload, all of it offloaded.
    assert 0 < recompute["offloaded_bytes"] < full["offloaded_bytes"]
    assert recompute["late_reloads"] == 0 and recompute["peak_kept"] == 0


def test_offload_composes_with_megatron_fine_grained_offloading(gloo_pool1):
    fine = {
        "fine_grained_activation_offloading": True,
        "offload_modules": ["core_attn", "attn_proj"],
        "min_offloaded_tensor_size": 1,
    }
    envs = {"off": None, "alone": {"TITAN_ACT_OFFLOAD_MIN_GAP": "0"}}
    (plain,) = gloo_pool1.run(offload_task, {}, {}, 2, envs)
    envs = {"megatron": None, "both": {"TITAN_ACT_OFFLOAD_MIN_GAP": "0"}}
    (result,) = gloo_pool1.run(offload_task, {}, fine, 2, envs)
    # Same numbers with megatron's offload, ours, both, or none.
    assert_identical(plain["off"], result["megatron"])
    assert_identical(plain["off"], result["both"])
    alone, both = plain["alone"]["stats"], result["both"]["stats"]
    # Inside megatron's offload regions its hooks are on top of ours: those saves are its own.
    assert 0 < both["offloaded_bytes"] < alone["offloaded_bytes"]
    assert both["late_reloads"] == 0


def test_offload_host_budget_warns_and_training_continues(gloo_pool2):
    envs = {"off": None, "tight": {"TITAN_ACT_OFFLOAD_MAX_HOST_BYTES": "64K"}}
    results = gloo_pool2.run(offload_task, {"pp": 2}, {"num_layers": 4}, 4, envs)
    for result in results:
        assert_identical(result["off"], result["tight"])
    stage0 = next(r for r in results if r["pp_rank"] == 0)["tight"]
    assert stage0["stats"]["kept_over_budget_bytes"] > 0
    assert any("host buffer budget reached" in w for w in stage0["warnings"])
    # The pool never held more than the budget.
    assert stage0["host_pool"]["capacity"] <= 64 << 10


def test_offload_stays_out_of_ep_overlap_schedules(gloo_pool2):
    # overlap_moe_expert_parallel_comm (combined 1F1B) runs two microbatches inside one schedule
    # step, so (chunk, microbatch) units do not hold: the plugin refuses, says so, changes nothing.
    overrides = {"bf16": True, "overlap_moe_expert_parallel_comm": True}
    results = gloo_pool2.run(offload_task, {"ep": 2}, overrides, 2, {"off": None, "on": {}})
    for result in results:
        assert_identical(result["off"], result["on"])
        assert result["on"]["stats"] is None
        # It says so in the effects table instead of leaving the row empty.
        assert result["on"]["effects"] == {"stepped_aside": "overlap_moe_expert_parallel_comm"}
        assert any("overlap_moe_expert_parallel_comm" in w for w in result["on"]["warnings"])


def unsupported_task() -> dict[str, Any]:
    """Activate the plugin while megatron-core claims to be 0.15.3 (its patches are gated)."""
    from titan_act_offload import plugin

    from titan_plugins.patching import gates

    real = gates.resolve_version
    gates.resolve_version = lambda d: ("0.15.3", "metadata") if d == "megatron-core" else real(d)
    try:
        with plugin_active("act_offload") as engine:
            statuses = {p.status for p in engine.patches() if p.plugin == "act_offload"}
            return {
                "statuses": statuses,
                "report": plugin.titan_report(),
                "effects": plugin.titan_effects(),
            }
    finally:
        gates.resolve_version = real


def test_offload_report_says_inactive_on_an_unsupported_megatron(gloo_pool1):
    # Every patch is version-gated: on megatron-core 0.15 they are all skipped, and the plugin
    # must not claim to be active (issue 14).
    (result,) = gloo_pool1.run(unsupported_task)
    # (a target module no worker task imported yet, e.g. MLA's, is still pending)
    assert "skipped" in result["statuses"] and "applied" not in result["statuses"]
    report = result["report"]
    assert report["active"] is False
    assert "0.15.3" in report["inactive_reason"] and "outside" in report["inactive_reason"]
    assert result["effects"] == {}


def expert_records_task() -> dict[str, Any]:
    """Status of each ``experts`` block record on the installed line, and its line's version."""
    import megatron.core.transformer.moe.experts  # noqa: F401  (the records' module, imported)
    from megatron.core import package_info

    with plugin_active("act_offload", {"TITAN_ACT_OFFLOAD_MODULES": "experts"}) as engine:
        statuses = {p.id: (p.status, p.detail) for p in engine.patches()}
    return {"version": package_info.__version__, "statuses": statuses}


def test_each_expert_record_declares_the_lines_it_serves(gloo_pool1):
    # GroupedMLP (the legacy grouped GEMM) is gone from 0.17 (upstream commit 2caa681a1d): its
    # record is written for 0.16 and says so on later lines, instead of a skip that reads like a
    # missing module; SequentialMLP is wrapped on every line.
    (result,) = gloo_pool1.run(expert_records_task)
    line = tuple(int(p) for p in result["version"].split(".")[:2])
    statuses = result["statuses"]
    assert statuses["act_offload.block.experts.SequentialMLP.forward"][0] == "applied"
    grouped, detail = statuses["act_offload.block.experts.GroupedMLP.forward"]
    if line < (0, 17):
        assert grouped == "applied"
    else:
        assert grouped == "other line", detail
        assert "<0.17" in detail and result["version"] in detail
