"""Every installed plugin together, and each one off: the composition matrix.

The tiny MoE GPT (hidden 128, 4 experts top-2, one layer per stage, bf16 with blockwise FP8 as
DeepSeek-V3 trains) runs 2 steps of 4 microbatches through megatron-core's own 1F1B schedule at
PP=2 x EP=2 (4 shared gloo workers): once with every installed plugin on, and once per plugin
with that one off. Each run starts from the same weights (``init_parallel`` reseeds), so any
difference is the switched plugin's. With moe_ep_overlap on, the MoE layers use the flex
dispatcher (its DeepEP-API backend, token chunks pipelined); off, megatron's alltoall
dispatcher. Plugin knobs are at their defaults (the defaults must act), except trace capture,
which records the first iteration of the all-on run (the profiler is the slow part; the other
runs have trace_analysis on but idle).

What must hold, and why:

* ``act_offload`` moves saved tensors to host and back bit for bit: losses, grad norms and every
  gradient equal the run without it. ``pp_rdma`` only changes the transport and
  ``trace_analysis`` only observes: bit-identical too. A plugin not listed in ``BOUNDS`` must be
  bit-identical (a plugin that changes numbers declares its bound here).
* ``fp8_blockwise`` changes the numbers by its quantization: the per-step relative loss gap
  is at most 1.5% (the bound its own 100-step test asserts, 4-5x the measured gap) and not 0.
* ``moe_ep_overlap`` with FP8: both runs are FP8 runs of the same math, but the pipelined run
  quantizes each token chunk's expert weight-gradient operands in its own 1x128 token tiles and
  combines expert outputs in another order (flex vs alltoall dispatcher). Each FP8 run is within
  1.5% (relative loss) of the high-precision math, so the two are within 3% of each other;
  grad norms likewise within 3%.
* Effects are read after the run from what the plugins counted (``titan_effects``), never from
  their configuration: every rank ran its FP8 GEMMs (3 per FP8 linear call); act_offload moved
  bytes on stage 0 (whose microbatches wait), including fp8_blockwise's FP8 copies and scales
  (marked through ``titan_plugins.saved_tensors``: with FP8 on, no more tensors are skipped as
  non-activations than with FP8 off), and cut the stage's saved-activation peak by what
  ``titan-plugins plan`` predicts for "fp8_blockwise+act_offload".
"""

from __future__ import annotations

import os
from importlib import metadata

import pytest
import torch

from titan_plugins.manager import FIRST_PARTY
from titan_plugins.verify import differential

pytestmark = pytest.mark.multiprocess

STEPS, MICROBATCHES, HIDDEN = 2, 4, 128
FP8_BOUND = 0.015  # relative loss gap of FP8 vs high precision (fp8_blockwise's own test)
BOUNDS = {"fp8_blockwise": FP8_BOUND, "moe_ep_overlap": 2 * FP8_BOUND}
INSTALLED = sorted(ep.name for ep in metadata.entry_points(group="titan_plugins"))
ENV = {
    "TITAN_MOE_EP_OVERLAP_AUTO": "0",  # always pipeline the chunks (no timing-based choice)
    "TITAN_TRACE_STEPS": "",  # capture off but in the all-on run
}
TRACE = {"TITAN_TRACE_STEPS": "1"}  # iteration 1, written when iteration 2 starts


def _config(plugins: list[str]):
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    flags: dict = {"bf16": True, "hidden_size": HIDDEN, "ffn_hidden_size": 2 * HIDDEN}
    if "fp8_blockwise" in plugins:
        flags.update(fp8="e4m3", fp8_recipe="blockwise")
    if "moe_ep_overlap" in plugins:  # megatron's flex dispatcher on the plugin's DeepEP API
        flags.update(
            moe_token_dispatcher_type="flex",
            moe_flex_dispatcher_backend="deepep",
            moe_router_dtype="fp32",
        )
    return tiny_gpt.make_config(**flags)


def _reset_counters(plugins: list[str]) -> None:
    """Counters and one-shot state the plugins keep per process (workers are shared)."""
    if "fp8_blockwise" in plugins:
        from titan_fp8_blockwise import effects

        effects.reset()
    if "trace_analysis" in plugins:
        from titan_trace_analysis import capture

        capture.reset()  # the capture reads TITAN_TRACE_STEPS again


def matrix_task(runs: dict[str, list[str]], trace_root: str) -> dict:
    """Worker task: train once per entry of ``runs`` (name -> plugins on); return numbers."""
    from megatron.core import parallel_state as ps

    from titan_plugins import report
    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.hosts.megatron.testing.model_state import named_global_parameters
    from titan_plugins.testing import plugin_active

    rank = torch.distributed.get_rank()
    out: dict = {"pp_rank": None}
    for name, plugins in runs.items():
        tiny_gpt.init_parallel(pp=2, ep=2)
        trace_dir = os.path.join(trace_root, name)
        env = {**ENV, "TITAN_TRACE_DIR": trace_dir, **(TRACE if name == "all" else {})}
        with plugin_active(plugins, env) as engine:
            _reset_counters(plugins)
            cfg = _config(plugins)
            chunks = tiny_gpt.build_model(cfg)
            losses, norms = tiny_gpt.train(chunks, cfg, STEPS, MICROBATCHES)
            grads = {n: p.main_grad.detach().clone() for n, p in named_global_parameters(chunks)}
            effects = report.effects()
            reports = {p["name"]: p.get("report", {}) for p in report.collect()["plugins"]}
            failed = [p.id for p in engine.patches() if p.status == "failed"]
        out[name] = {
            "losses": losses,
            "norms": norms,
            "grads": grads,
            "effects": effects,
            "reports": reports,
            "failed": failed,
            "traces": sorted(os.listdir(trace_dir)) if os.path.isdir(trace_dir) else [],
        }
    out["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    out["rank"] = rank
    return out


@pytest.fixture(scope="module")
def matrix(gloo_pool4, tmp_path_factory):
    # The test command installs every plugin this project ships (scripts/bootstrap.sh); one
    # missing is a broken set-up, and the matrix is about all of them together.
    missing = sorted(set(FIRST_PARTY) - set(INSTALLED))
    assert not missing, f"not installed: {', '.join(missing)} (run ./scripts/bootstrap.sh)"
    runs = {"all": list(INSTALLED)}
    runs.update({f"-{p}": [q for q in INSTALLED if q != p] for p in INSTALLED})
    root = str(tmp_path_factory.mktemp("traces"))
    return gloo_pool4.run(matrix_task, runs, root, timeout=900)


def _rel_gaps(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


@pytest.mark.parametrize("plugin", INSTALLED)
def test_compose_each_plugin_off_changes_only_what_it_owns(matrix, plugin):
    for rank in matrix:
        on, off = rank["all"], rank[f"-{plugin}"]
        assert on["failed"] == [] and off["failed"] == []
        bound = BOUNDS.get(plugin)
        if bound is None:  # bit-identical: losses, grad norms, every gradient
            assert on["losses"] == off["losses"], plugin
            assert on["norms"] == off["norms"], plugin
            assert on["grads"].keys() == off["grads"].keys()
            for name, grad in off["grads"].items():
                assert torch.equal(on["grads"][name], grad), (plugin, name)
            continue
        assert max(_rel_gaps(on["norms"], off["norms"])) <= bound, (plugin, on["norms"])
        if rank["pp_rank"] == 1:  # the last stage reports the losses
            gaps = _rel_gaps(on["losses"], off["losses"])
            assert max(gaps) <= bound, (plugin, on["losses"], off["losses"])
            if plugin == "fp8_blockwise":
                assert max(gaps) > 0  # FP8 really ran (its GEMMs are counted below too)


def test_compose_fp8_gemms_ran_on_every_rank(matrix):
    # Per microbatch and rank: attention's qkv and proj (2 calls) and the experts (2 local
    # experts x fc1, fc2), the experts once per token chunk when moe_ep_overlap pipelines them;
    # each call runs 3 FP8 GEMMs (forward, input gradient, weight gradient). The output head and
    # the router stay high precision (the default).
    chunks = 4  # moe_ep_overlap pipelines every MoE call (TITAN_MOE_EP_OVERLAP_AUTO=0)
    calls = MICROBATCHES * STEPS * (2 + 4 * chunks)
    for rank in matrix:
        done = rank["all"]["effects"]["fp8_blockwise"]
        assert done["fp8_layer_calls"] == calls
        assert done["fp8_gemms"] == 3 * calls
        assert done["fp8_fprop_gemms"] == done["fp8_dgrad_gemms"] == done["fp8_wgrad_gemms"]
        assert rank["-fp8_blockwise"]["effects"].get("fp8_blockwise", {}) == {}


def test_compose_act_offload_moves_fp8_copies_and_cuts_the_peak(matrix):
    for rank in matrix:
        done = rank["all"]["effects"]["act_offload"]
        skipped_fp8 = rank["all"]["reports"]["act_offload"]["skipped"]
        skipped_plain = rank["-fp8_blockwise"]["reports"]["act_offload"]["skipped"]
        # FP8 copies and scales are saved without a grad_fn: marked, they are activations.
        # FP8 adds no "leaf" skip (issue 12 measured 444 vs 12 per rank before the contract).
        fp8_leaves = skipped_fp8.get("leaf", {}).get("tensors", 0)
        assert fp8_leaves <= skipped_plain.get("leaf", {}).get("tensors", 0)
        if rank["pp_rank"] == 0:  # 1F1B stage 0: every microbatch waits for its backward
            assert done["offloaded_units"] == done["units"] == MICROBATCHES
            assert done["offloaded_bytes"] > 0 and done["reloaded_bytes"] == done["offloaded_bytes"]
            assert done["peak_saved_bytes"] < 0.6 * done["peak_saved_bytes_without"]
        else:  # the last stage runs each backward right after its forward: nothing waits
            assert done["offloaded_units"] == done["offloaded_bytes"] == 0
            assert done["peak_saved_bytes"] == done["peak_saved_bytes_without"]
        assert rank["-act_offload"]["effects"].get("act_offload", {}) == {}


def test_compose_trace_capture_wrote_a_trace(matrix):
    for rank in matrix:
        assert rank["all"]["traces"] and rank["-trace_analysis"]["traces"] == []


# The matrix model as Megatron-LM flags (the "-moe_ep_overlap" run: megatron's own alltoall
# dispatcher, which the planner models; PP=2 x EP=2 on 4 ranks is DP 2, so 16 samples make the
# 4 microbatches of 2 sequences per rank).
PLAN_FLAGS = (
    "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 16 "
    "--num-experts 4 --moe-router-topk 2 --vocab-size 128 --make-vocab-size-divisible-by 1 "
    "--disable-bias-linear --transformer-impl local --hidden-dropout 0 --attention-dropout 0 "
    "--untie-embeddings-and-output-weights --attention-softmax-in-fp32 "
    "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 "
    "--bf16 --fp8-format e4m3 --fp8-recipe blockwise"
).split()


def test_compose_plan_predicts_the_measured_offload_cut(matrix):
    # titan-plugins plan's "fp8_blockwise" and "fp8_blockwise+act_offload" columns against what
    # act_offload measured in the same layout (its peaks cover every tensor the forward saved,
    # with and without offload; parameters excluded, as in the plan). Routing decides each EP
    # rank's expert tokens while the plan assumes balanced routing, so a stage's two EP ranks
    # are summed (as tests/test_plan_measured.py does): each figure within 10% (the planner's
    # activation tolerance there), the cut (1 - with / without) within 0.05.
    from titan_plugins.plan.flags import parse_flags
    from titan_plugins.plan.from_flags import build_config
    from titan_plugins.plan.memory import stage_memory

    run = "-moe_ep_overlap"  # alltoall: the planner does not model the chunks
    stages = stage_memory(build_config(parse_flags(PLAN_FLAGS), world=4))
    for stage in stages:
        measured = [r[run]["effects"]["act_offload"] for r in matrix if r["pp_rank"] == stage.rank]
        with_offload = sum(m["peak_saved_bytes"] for m in measured)
        without = sum(m["peak_saved_bytes_without"] for m in measured)
        plan = {k: len(measured) * v for k, v in stage.activations.items()}
        plan_with, plan_without = plan["fp8_blockwise+act_offload"], plan["fp8_blockwise"]
        assert abs(without / plan_without - 1) < 0.10, (stage.rank, without, plan)
        assert abs(with_offload / plan_with - 1) < 0.10, (stage.rank, with_offload, plan)
        cut, plan_cut = 1 - with_offload / without, 1 - plan_with / plan_without
        assert abs(cut - plan_cut) < 0.05, (stage.rank, cut, plan_cut)
        if stage.rank == 0:  # stage 0 waits: a real cut, predicted (0.45 at this size)
            assert plan_cut > 0.3


def _answers_effects(plugin: str) -> bool:
    (ep,) = [ep for ep in metadata.entry_points(group="titan_plugins") if ep.name == plugin]
    return hasattr(ep.load(), "titan_effects")


# Plugins with no work in a training step (they act when something outside the step calls them),
# as their data files declare it for titan-plugins verify.
OUTSIDE_THE_STEP = {
    name
    for name, spec in differential.specs(differential.installed_plugins()).items()
    if spec.outside_the_step
}


@pytest.mark.parametrize("plugin", INSTALLED)
def test_compose_every_plugin_counted_its_work(matrix, plugin):
    # Every plugin reports what it did (titan_effects); after the all-on run each counted
    # something on some rank, and nothing in the run it was off.
    assert _answers_effects(plugin), f"{plugin} does not implement titan_effects"
    if plugin in OUTSIDE_THE_STEP:
        counted = [rank["all"]["effects"].get(plugin, {}) for rank in matrix]
        assert not any(value for done in counted for value in done.values()), (plugin, counted)
        return  # it changed nothing in the run either (the bit-identical test above)
    counted = [rank["all"]["effects"].get(plugin, {}) for rank in matrix]
    assert any(value for done in counted for value in done.values()), (plugin, counted)
    assert all(plugin not in rank[f"-{plugin}"]["effects"] for rank in matrix)
