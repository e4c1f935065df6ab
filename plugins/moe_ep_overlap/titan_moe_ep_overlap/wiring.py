"""What megatron-core's fused_a2a / token_dispatcher get when no compatible DeepEP is installed.

megatron-core defines ``fused_dispatch`` / ``fused_combine`` / ``set_deepep_num_sms`` only when
``from deep_ep import Buffer`` succeeds, and its autograd functions ``FusedDispatch`` /
``FusedCombine`` look ``Buffer``, ``EventHandle`` and ``EventOverlap`` up in fused_a2a's module
globals at call time. We give those globals our backend's classes and bind these three thin entry
points, so megatron's own autograd code (forward, backward, cached dispatch in the combine's
backward) runs unchanged on torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch


def _fused_a2a() -> Any:
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a


def fused_dispatch(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    token_probs: torch.Tensor,
    num_experts: int,
    group: torch.distributed.ProcessGroup,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> Any:
    """megatron's ``fused_dispatch`` (DeepEP path) through ``FusedDispatch`` on our Buffer."""
    return _fused_a2a().FusedDispatch.apply(
        x.contiguous(), token_indices, token_probs, num_experts, group, async_finish,
        allocate_on_comm_stream,
    )  # fmt: skip


def fused_combine(
    x: torch.Tensor,
    group: torch.distributed.ProcessGroup,
    handle: Any,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> Any:
    """megatron's ``fused_combine`` (DeepEP path) through ``FusedCombine`` on our Buffer."""
    return _fused_a2a().FusedCombine.apply(x, group, handle, async_finish, allocate_on_comm_stream)


def set_deepep_num_sms(num_sms: int) -> None:
    """megatron's ``set_deepep_num_sms``: forwarded to the Buffer class in use."""
    _fused_a2a().Buffer.set_num_sms(num_sms)
