"""The torch.distributed fallback, fixed where upstream 0.16.1 is not.

- ``batched_p2p_ops_fixed`` posts sends as [next, prev] and receives as [prev, next]. Upstream's
  ``_batched_p2p_ops`` (p2p_communication.py:16) posts [send_prev, recv_prev, send_next,
  recv_next]; with PP=2 prev == next and P2P matching is FIFO per peer, so under VPP an activation
  lands in the gradient buffer (same shape, no error: NVIDIA/Megatron-LM #750, #1450).
- ``HeldWork`` keeps the *storage* a send reads alive until the send completes:
  ``deallocate_output_tensor`` replaces ``out.data`` right after posting the send under
  ``overlap_p2p_comm``, which frees the old storage while gloo (or any non-caching backend) is
  still reading it. Holding the tensor object is not enough (``.data =`` swaps its storage), so
  the send is posted on a ``detach()`` alias, which keeps the old storage.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class HeldWork:
    """A torch.distributed Work that pins the tensors it reads until ``wait()``.

    ``wait()`` without an argument waits at most ``timeout_s`` (``TITAN_PP_RDMA_TIMEOUT_S``)
    instead of the process group's timeout, so a dead peer fails the step in bounded time.
    """

    def __init__(
        self, work: Any, keep: tuple[torch.Tensor | None, ...] = (), timeout_s: float | None = None
    ) -> None:
        self._work = work
        self._keep = keep
        self._timeout = None if timeout_s is None else timedelta(seconds=timeout_s)

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the underlying work, then release the pinned storage."""
        timeout = timeout if timeout is not None else self._timeout
        result = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._keep = ()
        return result

    def is_completed(self) -> bool:
        """Whether the underlying work finished."""
        return self._work.is_completed()


def alias(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor sharing ``t``'s current storage that ``t.data = ...`` cannot repoint."""
    return None if t is None else t.detach()


def batched_p2p_ops_fixed(
    *,
    tensor_send_prev: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    group: Any,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
    timeout_s: float | None = None,
) -> list[Any]:
    """Drop-in for megatron's ``_batched_p2p_ops`` with an order that is FIFO-safe for PP=2."""
    plan = (
        (dist.isend, tensor_send_next, next_pipeline_rank),
        (dist.isend, tensor_send_prev, prev_pipeline_rank),
        (dist.irecv, tensor_recv_prev, prev_pipeline_rank),
        (dist.irecv, tensor_recv_next, next_pipeline_rank),
    )
    ops = [dist.P2POp(fn, t, peer, group) for fn, t, peer in plan if t is not None]
    if not ops:
        return []
    keep = tuple(t for _, t, _ in plan[:2] if t is not None)
    return [HeldWork(w, keep, timeout_s) for w in dist.batch_isend_irecv(ops)]
