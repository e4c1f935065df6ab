"""A megatron MoELayer on the flex dispatcher with our backend (chunked pipeline or not) against
the stock ``MoEAlltoAllTokenDispatcher`` layer with the same weights, on gloo at EP=2 and EP=4.

What must be equal, and why:
- bit-identical (output, input gradient, every parameter gradient) with 1 chunk, top-k <= 2 and
  no padding: both paths run each expert's GEMMs on the same rows in the same order and add the
  (at most two) copies of a token in the same order.
- otherwise within 16 ulps of the largest reference element (observed <= 6). The math is the
  same; only the rounding differs, from three sources: CPU GEMM results depend on the row count
  (chunks and capacity padding change it), the chunked expert weight gradient is a sum of
  per-chunk ``x_c^T g_c``, and with top-k > 2 the combine adds per-rank partial sums. Every
  compared element is an fp32 sum of at most 128 products, so each path is within
  ``gamma_128 * sum|terms|`` of the exact value; 16 ulps of max|ref| is far tighter than that
  worst case and well above what the different groupings produce.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from titan_plugins.hosts.megatron.testing.model_state import outputs_and_grads

EPS32 = torch.finfo(torch.float32).eps
# our backend, and the configured chunk count on every call (no automatic serial fallback)
FIXED = {"TITAN_MOE_EP_OVERLAP_BACKEND": "torch", "TITAN_MOE_EP_OVERLAP_AUTO": "0"}
ULPS = 16  # bound in units of eps * max|reference| where bit-identity is not expected

# (experts, topk, capacity factor, pad to capacity (reference only), shared expert, skewed routing,
#  selective recompute of the MoE layer)
LAYER_CASES = [
    (4, 2, None, False, False, False, False),
    (8, 1, None, False, True, True, False),  # all routed to rank 0: other ranks get no tokens
    (8, 8, None, False, False, False, False),
    (8, 2, 0.5, False, False, False, False),  # dropping
    (8, 2, 0.5, True, True, False, False),  # dropping + padding in the reference
    (4, 2, None, False, False, False, True),  # recompute: the pipeline reruns in backward
]
CHUNKS = (1, 2, 4)


def _build_layer(cfg):
    """megatron's MoE layer of the local GPT spec: a ModuleSpec up to 0.17, a builder
    (``functools.partial`` of ``MoELayer``) from 0.18."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    mlp = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts).submodules.mlp
    return build_module(mlp, config=cfg) if isinstance(mlp, ModuleSpec) else mlp(config=cfg)


def _config(ep: int, case: tuple, dispatcher: str):
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    experts, topk, capacity, pad, shared, _, recompute = case
    extra = {}
    if capacity is not None:
        extra.update(moe_expert_capacity_factor=capacity, moe_token_drop_policy="probs")
        extra["moe_pad_expert_input_to_capacity"] = pad and dispatcher == "alltoall"
    if shared:
        extra["moe_shared_expert_intermediate_size"] = 96
    if topk == 1:
        extra["moe_router_pre_softmax"] = True  # megatron requires it for top-1
    if recompute:
        extra.update(recompute_granularity="selective", recompute_modules=["moe"])
    return tiny_gpt.make_config(
        num_layers=1, num_moe_experts=experts, moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher, moe_router_dtype="fp32", **extra,
    )  # fmt: skip


def _skew_router(layer, ep: int) -> None:
    """Make every token prefer the experts of EP rank 0 (feature 0 is large, see ``_inputs``)."""
    local = layer.config.num_moe_experts // ep
    with torch.no_grad():
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[:local, 0] = 5.0


def _inputs(seed: int, skew: bool, even: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    # uneven tokens per rank, except with capacity padding: megatron's alltoall dispatcher then
    # assumes every rank has the same capacity, i.e. the same token count
    x = torch.randn(8 if even else 6 + dist.get_rank(), 2, 64, generator=gen)
    if skew:
        x[..., 0] = 3.0
    return x, torch.randn(x.shape, generator=gen)


def task_layer_matrix(ep: int, cases: list[tuple], chunks: tuple[int, ...], seed: int) -> list:
    """For each case: stock alltoall layer vs our flex layer per chunk count.

    Returns per case and chunk count ``{quantity: max |diff|}`` plus the allowed bound of each
    expert weight gradient, and per chunk count the path the layer call took.
    """
    from titan_moe_ep_overlap import stats

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=ep)
    results = []
    with plugin_active("moe_ep_overlap", env=FIXED):
        for index, case in enumerate(cases):
            t0 = time.perf_counter()
            ref_layer = _build_layer(_config(ep, case, "alltoall"))
            for p in ref_layer.router.parameters():
                dist.broadcast(p.data, 0)  # the router is replicated across EP ranks
            if ref_layer.shared_experts is not None:
                for p in ref_layer.shared_experts.parameters():
                    dist.broadcast(p.data, 0)
            if case[5]:
                _skew_router(ref_layer, ep)
            flex_layer = _build_layer(_config(ep, case, "flex"))
            flex_layer.load_state_dict(ref_layer.state_dict())
            x, weight = _inputs(seed + index, case[5], even=case[3])
            ref = outputs_and_grads(ref_layer, x, weight)
            per_chunks, paths = {}, {}
            for count in chunks:
                os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = str(count)
                stats.reset()
                ours = outputs_and_grads(flex_layer, x, weight)
                counts = stats.counts()
                paths[count] = (counts["pipelined_calls"], counts["serial_calls"])
                assert ours.keys() == ref.keys(), (ours.keys(), ref.keys())
                per_chunks[count] = {k: (ours[k] - ref[k]).abs().max().item() for k in ref}
            scale = {k: ref[k].abs().max().item() for k in ref}
            results.append({"diffs": per_chunks, "scale": scale, "paths": paths,
                            "time": time.perf_counter() - t0})  # fmt: skip
    return results


def _exact(case: tuple, chunks: int) -> bool:
    """Same GEMM shapes and the same top-k summation grouping as the reference: bit-identical."""
    _, topk, _, pad, _, _, _ = case
    return chunks == 1 and not pad and topk <= 2


def _check(results: list) -> None:
    for case, result in zip(LAYER_CASES, results):
        # the path asked for ran, on every Megatron line: the pipeline with n > 1 chunks
        # (megatron's forward alone would match the reference too), its own serial path with 1
        assert result["paths"] == {n: (int(n > 1), int(n == 1)) for n in CHUNKS}, (case, result)
        for count, diffs in result["diffs"].items():
            for key, diff in diffs.items():
                if _exact(case, count):
                    assert diff == 0.0, (case, count, key, diff)
                else:
                    assert diff <= ULPS * EPS32 * result["scale"][key], (case, count, key, diff)


@pytest.mark.multiprocess
def test_moe_layer_flex_equals_alltoall_ep2(gloo_pool2) -> None:
    results = gloo_pool2.run(task_layer_matrix, 2, LAYER_CASES, CHUNKS, 11)
    for rank_results in results:
        _check(rank_results)


@pytest.mark.multiprocess
def test_moe_layer_flex_equals_alltoall_ep4(gloo_pool4) -> None:
    results = gloo_pool4.run(task_layer_matrix, 4, LAYER_CASES, CHUNKS, 23)
    for rank_results in results:
        _check(rank_results)


def task_tp2_ep2(chunks: tuple[int, ...], seed: int) -> dict:
    """TP=2 x EP=2 with sequence parallelism: the flex dispatcher's group is TP x EP. Reference:
    the same flex layer unchunked (megatron's alltoall dispatcher cannot run TP>1 on gloo: it
    all-gathers uneven token counts, which gloo does not support)."""
    from titan_moe_ep_overlap import stats

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(tp=2, ep=2)
    out = {}
    with plugin_active("moe_ep_overlap", env=FIXED):
        cfg = tiny_gpt.make_config(
            num_layers=1, moe_token_dispatcher_type="flex", moe_router_dtype="fp32",
            sequence_parallel=True,
        )  # fmt: skip
        layer = _build_layer(cfg)
        for p in layer.router.parameters():
            dist.broadcast(p.data, 0)
        x, weight = _inputs(seed, False, even=True)
        os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = "1"
        ref = outputs_and_grads(layer, x, weight)
        for count in chunks:
            os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = str(count)
            stats.reset()
            ours = outputs_and_grads(layer, x, weight)
            out[count] = {
                k: ((ours[k] - ref[k]).abs().max().item(), ref[k].abs().max().item()) for k in ref
            }
            out[count]["pipelined_calls"] = (stats.counts()["pipelined_calls"], 1)
    return out


@pytest.mark.multiprocess
def test_moe_layer_tp2_ep2_chunked_equals_unchunked(gloo_pool4) -> None:
    """Chunked vs unchunked: within 16 ulps of the largest element (see the module docstring)."""
    for res in gloo_pool4.run(task_tp2_ep2, (2, 4), 31):
        for count, diffs in res.items():
            assert diffs.pop("pipelined_calls") == (1, 1), (count, diffs)  # the pipeline ran
            for key, (diff, scale) in diffs.items():
                assert diff <= ULPS * EPS32 * scale, (count, key, diff)
