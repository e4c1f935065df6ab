"""DeepEP v1 ``Buffer`` (normal, intranode-style kernels) on torch.distributed all-to-alls.

Same Python API and semantics as ``deep_ep.Buffer`` v1.x for everything megatron-core and typical
DeepEP users call: ``get_dispatch_layout``, ``dispatch`` (fresh and cached with a handle),
``combine`` (fp32 sum of the copies, optional bias, topk-weight sum), ``EventOverlap`` events with
``async_finish`` / ``previous_event`` / ``allocate_on_comm_stream``. Works on any process group
torch.distributed supports (NCCL, MCCL, gloo). Low-latency mode is not provided.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from titan_moe_ep_overlap import deepep_config as _config
from titan_moe_ep_overlap import stats
from titan_moe_ep_overlap.comm import all_gather_rows
from titan_moe_ep_overlap.dispatch_ops import DispatchResult, combine_rows, dispatch_rows
from titan_moe_ep_overlap.events import (
    EventHandle,
    EventOverlap,
    check_stream_args,
    wait_previous,
)
from titan_moe_ep_overlap.layout import dispatch_layout

_LOW_LATENCY_FIX = (
    "moe_ep_overlap: low-latency mode is not provided by the torch.distributed backend; install "
    "DeepEP v1.x (pip install deep_ep from github.com/deepseek-ai/DeepEP, tag v1.2.1) for "
    "low_latency_dispatch/combine, or use the normal dispatch/combine."
)


class Buffer:
    """``deep_ep.Buffer`` work-alike; construct with the EP process group, as megatron does."""

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        comm: Any = None,
    ) -> None:
        if group is None:
            raise ValueError(
                "moe_ep_overlap Buffer needs a torch.distributed process group (mpi4py `comm` "
                "is not supported by the torch.distributed backend)"
            )
        if low_latency_mode:
            raise NotImplementedError(_LOW_LATENCY_FIX)
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = False
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.runtime = self  # DeepEP exposes its C++ runtime here; we are our own runtime
        self.destroyed = False

    # ---- DeepEP static / trivial API -------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count used by the configs (DeepEP requires an even number)."""
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP compiled for SM90 (no: this backend has no kernels of its own)."""
        return False

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _config.Config:
        """Recommended dispatch config for ``num_ranks``."""
        return _config.dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> _config.Config:
        """Recommended combine config for ``num_ranks``."""
        return _config.combine_config(Buffer.num_sms, num_ranks)

    def get_num_rdma_ranks(self) -> int:
        """Number of RDMA ranks (always 1: the backend is flat over the group)."""
        return 1

    def get_comm_stream(self) -> Any:
        """The stream collectives run on: the backend's own (NCCL/MCCL) or None on gloo."""
        return None

    def get_local_buffer_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Not available: the backend has no pre-registered communication buffer."""
        raise NotImplementedError(
            "moe_ep_overlap: get_local_buffer_tensor needs DeepEP's registered NVL/RDMA buffer, "
            "which the torch.distributed backend does not allocate"
        )

    def destroy(self) -> None:
        """Release the buffer (only with ``explicitly_destroy=True``, as in DeepEP)."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self.destroyed = True

    def low_latency_dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """Not provided (see the error message)."""
        raise NotImplementedError(_LOW_LATENCY_FIX)

    low_latency_combine = low_latency_dispatch
    clean_low_latency_buffer = low_latency_dispatch

    # ---- layout / dispatch / combine ----------------------------------------------------
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)``."""
        check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        wait_previous(previous_event)
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size)
        return per_rank, None, per_expert, in_rank, _finish(EventHandle(), async_finish)

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: tuple | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: _config.Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        layout_table: torch.Tensor | None = None,
    ) -> tuple[Any, Any, Any, Any, Any, EventOverlap]:
        """Send each token to every rank owning one of its experts (DeepEP ``dispatch``).

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; with ``handle`` given (cached mode) the middle four are None.
        ``layout_table`` (our extension) is this dispatch's entry of :meth:`exchange_layouts`;
        without it the counts are exchanged here (a blocking collective, as DeepEP's notify).
        """
        check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        wait_previous(previous_event)
        self._check_alive()
        stats.add("api_dispatches")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise AssertionError("cached dispatch (handle given) takes no topk_idx/weights")
            recv_x, works, finalize = dispatch_rows(x, handle, self.group, self.rank)
            event = EventHandle(works, finalize=finalize, keep_alive=(x, recv_x))
            return recv_x, None, None, None, None, _finish(event, async_finish)
        if any(
            t is None
            for t in (topk_idx, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert)
        ):
            raise ValueError(
                "dispatch without a handle needs topk_idx, topk_weights and the layout tensors "
                "num_tokens_per_rank / is_token_in_rank / num_tokens_per_expert "
                "(from get_dispatch_layout)"
            )
        table = layout_table
        if table is None:
            table = self.exchange_layouts([(num_tokens_per_rank, num_tokens_per_expert)])[0]
        result: DispatchResult = DispatchResult.start(
            x, topk_idx, topk_weights, is_token_in_rank, table, self, expert_alignment,
            num_worst_tokens,
        )  # fmt: skip
        event = EventHandle(result.works, finalize=result.finalize, keep_alive=result.keep_alive)
        return (
            result.recv_x,
            result.recv_topk_idx,
            result.recv_topk_weights,
            result.num_recv_tokens_per_expert_list,
            result.handle,
            _finish(event, async_finish),
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: _config.Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send expert outputs back and sum them per token in fp32 (DeepEP ``combine``).

        Returns ``(combined_x, combined_topk_weights, event)``; ``combined_x`` has ``x.dtype``.
        """
        check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        wait_previous(previous_event)
        self._check_alive()
        stats.add("api_combines")
        combined_x, combined_w, works, finalize, keep = combine_rows(
            x, handle, topk_weights, bias, self.group, self.rank
        )
        event = EventHandle(works, finalize=finalize, keep_alive=keep)
        return combined_x, combined_w, _finish(event, async_finish)

    def exchange_layouts(
        self, layouts: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """One blocking all-gather of the counts of several dispatches (our extension).

        ``layouts`` holds ``(num_tokens_per_rank, num_tokens_per_expert)`` per dispatch; the
        result holds each dispatch's ``[group size, ranks + experts]`` table, to pass as
        ``dispatch(..., layout_table=...)``. A pipeline of chunks thus synchronises once.
        """
        rows = [
            torch.cat([per_rank, per_expert]).to(torch.int64) for per_rank, per_expert in layouts
        ]
        table = all_gather_rows(torch.cat(rows), self.group)
        return list(torch.split(table, [r.numel() for r in rows], dim=1))

    def _check_alive(self) -> None:
        if self.destroyed:
            raise RuntimeError("moe_ep_overlap: this Buffer was destroyed")


def _finish(event: EventHandle, async_finish: bool) -> EventOverlap:
    """DeepEP returns a live event with ``async_finish``, else completes now and returns none."""
    if async_finish:
        return EventOverlap(event)
    event.current_stream_wait()
    return EventOverlap(None)
