"""The tiny MoE GPT trained through megatron-core's own schedules with the flex dispatcher on our
backend, against the stock alltoall dispatcher (EP=2, EP=4), and with megatron's combined-1F1B EP
overlap (``overlap_moe_expert_parallel_comm``) on and off.

Expected: with 1 chunk the losses and grad norms of every step are bit-identical to alltoall (the
MoE layer is bit-identical for top-2, see test_moe_ep_overlap_layer, so the Adam steps are too).
With 2/4 chunks the first step's loss/grad norm are within 16 ulps (same math, different GEMM row
blocking); later steps within 1e-5 relative: Adam normalises each update, so a rounding-level
gradient difference moves a weight by at most ``lr * O(1e-6)``.

Each run also checks that what was meant to run did: megatron's own flex dispatcher with its
``_DeepepManager`` (built because megatron's ``HAVE_DEEP_EP`` / ``fused_dispatch`` now say the
backend exists), and the plugin's counters: with 1 chunk every MoE layer call went through
megatron's unchunked ``FusedDispatch``/``FusedCombine`` on our Buffer, with n chunks every call
ran the pipeline with n dispatches and n combines each way.
"""

from __future__ import annotations

import os

import pytest
import torch

EPS32 = torch.finfo(torch.float32).eps
# our backend, and the configured chunk count on every call (no automatic serial fallback)
FIXED = {"TITAN_MOE_EP_OVERLAP_BACKEND": "torch", "TITAN_MOE_EP_OVERLAP_AUTO": "0"}
MICROBATCHES, LAYERS = 4, 2  # tiny_gpt's default layer count at PP=1


def _train(dispatcher: str, steps: int, state: dict | None, **overrides) -> tuple:
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    cfg = tiny_gpt.make_config(
        moe_token_dispatcher_type=dispatcher, moe_router_dtype="fp32", **overrides
    )
    chunks = tiny_gpt.build_model(cfg)
    module = chunks[0].module
    if state is None:
        state = {k: v.clone() for k, v in module.state_dict().items() if v is not None}
    else:
        module.load_state_dict(state)
    losses, norms = tiny_gpt.train(chunks, cfg, steps=steps, num_microbatches=MICROBATCHES)
    return losses, norms, state


def _train_counted(steps: int, state: dict) -> tuple:
    """Train flex (megatron's MoEFlexTokenDispatcher, "deepep" backend); return the losses,
    norms, the plugin's counters for this run and the dispatcher classes megatron built."""
    import titan_moe_ep_overlap
    from titan_moe_ep_overlap import stats

    stats.reset()
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    cfg = tiny_gpt.make_config(moe_token_dispatcher_type="flex", moe_router_dtype="fp32")
    assert cfg.moe_flex_dispatcher_backend == "deepep"
    chunks = tiny_gpt.build_model(cfg)
    chunks[0].module.load_state_dict(state)
    dispatcher = chunks[0].module.decoder.layers[0].mlp.token_dispatcher
    kinds = (type(dispatcher).__name__, type(dispatcher._comm_manager).__name__)
    losses, norms = tiny_gpt.train(chunks, cfg, steps=steps, num_microbatches=MICROBATCHES)
    return losses, norms, titan_moe_ep_overlap.effects(), kinds


def task_gpt_flex_vs_alltoall(ep: int, chunk_counts: tuple[int, ...], steps: int) -> dict:
    """Losses/grad norms of alltoall and of flex+ours per chunk count (same initial weights),
    with the counters of each flex run and megatron's DeepEP flag."""
    from megatron.core.transformer.moe import fused_a2a

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=ep)
    ref_losses, ref_norms, state = _train("alltoall", steps, None)
    out = {"ref": (ref_losses, ref_norms), "flag_off": fused_a2a.HAVE_DEEP_EP}
    with plugin_active("moe_ep_overlap", env=FIXED):
        out["flag_on"] = fused_a2a.HAVE_DEEP_EP
        for count in chunk_counts:
            os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = str(count)
            losses, norms, effects, kinds = _train_counted(steps, state)
            out[count] = (losses, norms)
            out[("effects", count)], out["kinds"] = effects, kinds
    out["flag_after"] = fused_a2a.HAVE_DEEP_EP
    return out


def task_gpt_ep_overlap(steps: int) -> dict:
    """bf16 flex+ours with megatron's combined-1F1B EP overlap on/off, 1 and 4 chunks, with
    what the plugin's effects table says for each run."""
    from titan_moe_ep_overlap import plugin, stats, upstream_paths

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=2)
    bf16 = dict(bf16=True, params_dtype=torch.bfloat16)
    out, state = {}, None
    upstream_paths.reset()
    with plugin_active("moe_ep_overlap", env=FIXED):
        for overlap in (False, True):
            for count in (1, 4):
                os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = str(count)
                stats.reset()
                losses, norms, state = _train(
                    "flex", steps, state, overlap_moe_expert_parallel_comm=overlap, **bf16
                )
                out[(overlap, count)] = (losses, norms)
                out[("effects", overlap, count)] = plugin.titan_effects()
    upstream_paths.reset()
    return out


def _close(a: list[float], b: list[float], first_ulps: float, rel: float) -> bool:
    if not a or not b:
        return a == b
    first = abs(a[0] - b[0]) <= first_ulps * EPS32 * abs(b[0])
    rest = all(abs(x - y) <= rel * abs(y) for x, y in zip(a[1:], b[1:]))
    return first and rest


def _check_counters(effects: dict, count: int, steps: int) -> None:
    """Every forward layer call of the run took the path ``count`` asks for, with ``count``
    dispatches and combines in the forward and again in the backward."""
    calls = steps * MICROBATCHES * LAYERS
    assert effects["layer_calls"] == calls, effects
    if count == 1:
        assert effects["serial_calls"] == calls and effects["pipelined_calls"] == 0, effects
        # megatron's FusedDispatch (forward) + FusedCombine.backward (cached dispatch), and
        # FusedCombine (forward) + FusedDispatch.backward (combine), all on our Buffer
        assert effects["api_dispatches"] == effects["api_combines"] == 2 * calls, effects
        return
    assert effects["pipelined_calls"] == calls and effects["serial_calls"] == 0, effects
    assert effects["chunks"] == count * calls, effects
    assert effects["pipeline_dispatches"] == effects["pipeline_combines"] == 2 * count * calls
    assert effects["api_dispatches"] == effects["pipeline_dispatches"], effects
    assert effects["last_pipelined_call"] == {
        "chunks": count, "dispatches": 2 * count, "combines": 2 * count,
    }, effects  # fmt: skip


def _check_flex_vs_alltoall(results: list[dict], steps: int) -> None:
    for res in results:
        assert (res["flag_off"], res["flag_on"], res["flag_after"]) == (False, True, False), res
        assert res["kinds"] == ("MoEFlexTokenDispatcher", "_DeepepManager"), res["kinds"]
        for count in [key for key in res if isinstance(key, int)]:
            _check_counters(res[("effects", count)], count, steps)
        ref_losses, ref_norms = res["ref"]
        assert res[1] == (ref_losses, ref_norms), (res[1], res["ref"])
        for count in (2, 4):
            if count in res:
                losses, norms = res[count]
                assert _close(losses, ref_losses, 16, 1e-5), (count, losses, ref_losses)
                assert _close(norms, ref_norms, 16, 1e-5), (count, norms, ref_norms)


@pytest.mark.multiprocess
def test_gpt_flex_equals_alltoall_ep2(gloo_pool2) -> None:
    _check_flex_vs_alltoall(gloo_pool2.run(task_gpt_flex_vs_alltoall, 2, (1, 2, 4), 3), 3)


@pytest.mark.multiprocess
def test_gpt_flex_equals_alltoall_ep4(gloo_pool4) -> None:
    _check_flex_vs_alltoall(gloo_pool4.run(task_gpt_flex_vs_alltoall, 4, (1, 4), 2), 2)


@pytest.mark.multiprocess
def test_gpt_with_megatron_ep_overlap(gloo_pool2) -> None:
    """Combined-1F1B EP overlap calls dispatch/experts/combine itself: same numbers as without.

    bf16: the 1-chunk runs use identical kernels in the same order, so they must be bit-identical;
    with megatron's overlap the chunk knob has no effect (it bypasses MoELayer.forward). Without
    it, 4 chunks change GEMM row blocking: single activations may move by one bf16 ulp (2**-8
    relative); averaged in the loss over 128 tokens that is 1e-4 relative (observed ~2e-6); the
    grad norm (bf16 gradients) within one bf16 ulp, 2**-8 relative (observed ~1.5e-4).
    """
    for res in gloo_pool2.run(task_gpt_ep_overlap, 2):
        for count in (1, 4):
            # megatron's overlap schedules dispatch and combine itself, on our backend: the
            # plugin composes (says so) and its pipeline never runs; without it, 4 chunks do
            ours, theirs = res[("effects", False, count)], res[("effects", True, count)]
            calls = 2 * MICROBATCHES * LAYERS  # 2 steps
            assert "composes_with" not in ours and ours["pipelined_calls"] == (count > 1) * calls
            assert theirs["composes_with"] == "overlap_moe_expert_parallel_comm", theirs
            assert theirs["pipelined_calls"] == 0 and theirs["api_dispatches"] > 0, theirs
        assert res[(True, 1)] == res[(False, 1)], res
        assert res[(True, 4)] == res[(True, 1)], res  # overlap path never chunks
        (losses, norms), (ref_losses, ref_norms) = res[(False, 4)], res[(False, 1)]
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, ref_losses)), res
        assert all(abs(a - b) <= 2**-8 * abs(b) for a, b in zip(norms, ref_norms)), res
