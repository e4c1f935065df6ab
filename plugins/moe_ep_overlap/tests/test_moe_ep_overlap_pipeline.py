"""The chunk pipeline (``overlap.ChunkedExperts``) in one process, on a loopback communicator that
records the order of issues and waits: the schedule really keeps transfers in flight across
expert compute, gradients match plain autograd, and expert outputs are not held until backward."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from titan_moe_ep_overlap.overlap import ChunkedExperts

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


class _Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def current_stream_wait(self) -> None:
        self.log.append(f"wait {self.name}")


class LoopbackComm:
    """Same-rank "transfers": results are copies; the log shows when each was started/awaited."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.n_dispatch = 0
        self.received: list = []  # weak references to the storage of the received tokens

    def layouts(self, indices: list) -> list:
        return [None] * len(indices)

    def dispatch(self, x, idx, probs, layout) -> tuple:
        i = self.n_dispatch
        self.n_dispatch += 1
        self.log.append(f"dispatch {i}")
        counts = [x.shape[0]]
        received = x.clone()
        self.received.append(weakref.ref(received.untyped_storage()))
        return received, idx, probs.clone(), counts, i, _Event(self.log, f"dispatch {i}")

    def redispatch(self, grad, handle) -> tuple:
        self.log.append(f"redispatch {handle}")
        return grad.clone(), None, None, None, None, _Event(self.log, f"redispatch {handle}")

    def combine(self, y, handle, weights=None) -> tuple:
        kind = "combine" if weights is None else "grad-combine"
        self.log.append(f"{kind} {handle}")
        w = None if weights is None else weights.clone()
        return y.clone(), w, _Event(self.log, f"{kind} {handle}")


def _experts(log: list, outputs: list, w1: torch.Tensor, w2: torch.Tensor):
    def compute(x, idx, p, counts):
        log.append("compute")
        # like megatron's permute: the experts see an index_select copy, x itself is not saved
        x = x.index_select(0, torch.arange(x.shape[0]))
        y = torch.nn.functional.gelu(x @ w1) @ w2 * p.sum(1, keepdim=True)
        outputs.append(y)
        return y

    return compute


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_pipeline_schedule_gradients_and_memory(chunks: int) -> None:
    gen = torch.Generator().manual_seed(chunks)
    hidden = torch.randn(10, 8, generator=gen, requires_grad=True)
    probs = torch.rand(10, 2, generator=gen, requires_grad=True)
    idx = torch.zeros(10, 2, dtype=torch.int64)
    w1 = torch.randn(8, 16, generator=gen, requires_grad=True)
    w2 = torch.randn(16, 8, generator=gen, requires_grad=True)
    grad = torch.randn(10, 8, generator=gen)

    comm, outputs = LoopbackComm(), []
    out = ChunkedExperts.apply(
        hidden, probs, idx, comm, _experts(comm.log, outputs, w1, w2), chunks
    )
    forward_log = list(comm.log)
    # expert outputs were released after their combine was issued (only the graph root remains),
    # and nothing keeps the received tokens alive until the backward
    assert len(outputs) == chunks and all(y.numel() == 1 for y in outputs)
    gc.collect()
    assert all(ref() is None for ref in comm.received)
    out.backward(grad)
    got = [t.grad.clone() for t in (hidden, probs, w1, w2)]

    for t in (hidden, probs, w1, w2):
        t.grad = None
    ref = torch.nn.functional.gelu(hidden @ w1) @ w2 * probs.sum(1, keepdim=True)
    ref.backward(grad)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    for g, t in zip(got, (hidden, probs, w1, w2)):
        assert torch.allclose(g, t.grad, rtol=1e-5, atol=1e-5)

    # forward: dispatch i+1 is issued before chunk i computes; combines are only awaited at the end
    computes = [i for i, e in enumerate(forward_log) if e == "compute"]
    for i in range(chunks - 1):
        assert forward_log.index(f"dispatch {i + 1}") < computes[i]
        assert forward_log.index(f"combine {i}") < computes[i + 1]
    assert all(forward_log.index(f"wait combine {i}") > computes[-1] for i in range(chunks))
    # backward: the gradient of chunk i+1 is re-dispatched before chunk i's combine is issued
    backward_log = comm.log[len(forward_log) :]
    for i in range(chunks - 1):
        assert backward_log.index(f"redispatch {i + 1}") < backward_log.index(f"grad-combine {i}")
    assert backward_log[-chunks:] == [f"wait grad-combine {i}" for i in range(chunks)]


def test_pipeline_without_grad_builds_no_graph() -> None:
    comm, outputs = LoopbackComm(), []
    w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    with torch.no_grad():
        out = ChunkedExperts.apply(
            torch.randn(6, 8), torch.rand(6, 2), torch.zeros(6, 2, dtype=torch.int64), comm,
            _experts(comm.log, outputs, w1, w2), 3,
        )  # fmt: skip
    assert out.shape == (6, 8) and all(y.grad_fn is None for y in outputs)
