"""Tensor-parallel communication of the FP8 linear on 2 gloo ranks vs one process.

A column-parallel shard (128 output rows per rank) with 128 tokens per rank keeps every 1x128
tile and 128x128 block of the single-process run, so the sharded results must equal the slices
of the single-process result up to fp32 summation order (the dgrad partial sums are reduced
across ranks): relative error < 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from titan_fp8_blockwise.linear import fp8_linear

M, K, N = 256, 384, 256
pytestmark = pytest.mark.multiprocess


def _tensors():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * 0.05
    dy = torch.randn(M, N, generator=gen)
    return x, w, dy


def _shard_task(sequence_parallel: bool) -> dict:
    """Worker task: column-parallel FP8 linear on this rank's shard (TP group = the world)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    x, w, dy = _tensors()
    cols = slice(rank * N // 2, (rank + 1) * N // 2)
    rows = slice(rank * M // 2, (rank + 1) * M // 2)
    x_in = (x[rows] if sequence_parallel else x).clone().requires_grad_()
    w_in = w[cols].clone().requires_grad_()
    y = fp8_linear(
        x_in,
        w_in,
        sequence_parallel=sequence_parallel,
        allreduce_dgrad=not sequence_parallel,
        tp_group=dist.group.WORLD,
    )
    y.backward(dy[:, cols])
    return {"y": y.detach(), "dx": x_in.grad, "dw": w_in.grad}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "allreduce"])
def test_fp8_tensor_parallel_matches_single_process(gloo_pool2, sequence_parallel):
    x, w, dy = _tensors()
    x, w = x.requires_grad_(), w.requires_grad_()
    y = fp8_linear(x, w)
    y.backward(dy)
    results = gloo_pool2.run(_shard_task, sequence_parallel)
    for rank, res in enumerate(results):
        cols = slice(rank * N // 2, (rank + 1) * N // 2)
        rows = slice(rank * M // 2, (rank + 1) * M // 2) if sequence_parallel else slice(None)
        assert _rel(res["y"], y.detach()[:, cols]) < 1e-6
        assert _rel(res["dw"], w.grad[cols]) < 1e-6
        assert _rel(res["dx"], x.grad[rows]) < 1e-6


class _GTPShard(torch.nn.Parameter):
    """Rows of a weight sharded over the world like megatron 0.19's GTPShardedParam: gathered
    for each GEMM, its gradient reduce-scattered into ``main_grad`` (the protocol megatron's
    own linear function uses; the real class needs TransformerEngine >= 2.19)."""

    def all_gather_and_prefetch(self, fwd: bool = True) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty((self.shape[0] * dist.get_world_size(), self.shape[1]))
        dist.all_gather_into_tensor(out, self.detach().contiguous())
        return out

    def all_gather_and_prefetch_bwd(self) -> torch.Tensor:
        return self.all_gather_and_prefetch(fwd=False)

    def wgrad_reduce_scatter(self, wgrad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        local = torch.empty(self.shape, dtype=wgrad.dtype)
        dist.reduce_scatter_tensor(local, wgrad.contiguous())
        self.main_grad.add_(local)
        return torch.zeros_like(self.main_grad)  # the synchronous case: a dummy gradient


def _gtp_task() -> dict:
    """Worker task: each rank holds half the weight's rows and its own half of the tokens."""
    import torch.distributed as dist

    rank = dist.get_rank()
    x, w, dy = _tensors()
    rows = slice(rank * M // 2, (rank + 1) * M // 2)
    shard = _GTPShard(w[rank * N // 2 : (rank + 1) * N // 2].clone())
    shard.main_grad = torch.zeros_like(shard.data)
    x_in = x[rows].clone().requires_grad_()
    y = fp8_linear(x_in, shard, gtp_remat_size=2)
    y.backward(dy[rows])
    return {"y": y.detach(), "dx": x_in.grad, "main_grad": shard.main_grad}


def test_fp8_tensor_parallel_gtp_sharded_weight_matches_single_process(gloo_pool2):
    # GTP ranks see different tokens (a data-parallel axis) and share one weight: each gathers
    # it for its GEMMs, and the weight gradient is the sum over ranks, scattered by rows.
    x, w, dy = _tensors()
    x, w = x.requires_grad_(), w.requires_grad_()
    y = fp8_linear(x, w)
    y.backward(dy)
    for rank, res in enumerate(gloo_pool2.run(_gtp_task)):
        tokens = slice(rank * M // 2, (rank + 1) * M // 2)
        assert _rel(res["y"], y.detach()[tokens]) < 1e-6  # same whole weight, same tiles
        assert _rel(res["dx"], x.grad[tokens]) < 1e-6
        assert _rel(res["main_grad"], w.grad[rank * N // 2 : (rank + 1) * N // 2]) < 1e-6
