"""The ``P2PCommunicator`` subclass megatron-core's schedules build (via the class patch).

Only ``_communicate`` changes; every public method of upstream's communicator funnels into it,
so the unmodified schedules (1F1B, interleaved, with or without ``overlap_p2p_comm`` /
``batch_p2p_comm``) use it as they are. The receive buffers are allocated exactly as upstream
does; the transfers go through Mooncake when the pipeline group's session has it, else through
torch.distributed with the fixed batch order and pinned send storage (``torch_p2p``).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_pp_rdma import effects
from titan_pp_rdma.settings import PPRdmaSettings
from titan_pp_rdma.torch_p2p import HeldWork, alias, batched_p2p_ops_fixed
from titan_pp_rdma.wire import BWD, FWD

_CLASSES: dict[type, type] = {}


def _device() -> Any:
    from titan_plugins.platform import current_device

    return current_device()


def build_communicator_class(base: type) -> type:
    """A subclass of megatron's ``P2PCommunicator`` ``base`` with the pp_rdma transport."""
    if base in _CLASSES:
        return _CLASSES[base]

    class PPRdmaP2PCommunicator(base):  # type: ignore[misc,valid-type]
        """megatron-core ``P2PCommunicator`` over Mooncake (torch.distributed fallback)."""

        titan_plugin = "pp_rdma"

        def _recv_buffer(self, shape: Any) -> torch.Tensor:
            cfg = self.config
            if cfg.pipeline_dtype is None:
                raise RuntimeError("pipeline_dtype must be provided to receive pipeline tensors")
            if shape is None:
                raise RuntimeError(
                    "tensor_shape must be specified to receive pipeline tensors. "
                    "Common tensor_shape is (seq_length, micro_batch_size, hidden_size)"
                )
            return torch.empty(
                shape, requires_grad=True, device=_device(), dtype=cfg.pipeline_dtype
            )

        def _communicate(
            self,
            *,
            tensor_send_next: torch.Tensor | None,
            tensor_send_prev: torch.Tensor | None,
            recv_prev: bool,
            recv_next: bool,
            tensor_shape: Any,
            wait_on_reqs: bool = True,
        ) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
            cfg = self.config
            if cfg.use_ring_exchange_p2p:  # a custom torch build's collective: leave it alone
                return super()._communicate(
                    tensor_send_next=tensor_send_next,
                    tensor_send_prev=tensor_send_prev,
                    recv_prev=recv_prev,
                    recv_next=recv_next,
                    tensor_shape=tensor_shape,
                    wait_on_reqs=wait_on_reqs,
                )
            # Knobs are read once per communicator (megatron builds one per schedule call).
            settings = self.__dict__.get("_pp_rdma_settings")
            if settings is None:
                settings = self._pp_rdma_settings = PPRdmaSettings.from_env()
            # Imported at first use: the session stack (Mooncake engine, transport) is not
            # needed while megatron imports, only when a schedule first communicates.
            from titan_pp_rdma.session import open_session

            session = open_session(self.pp_group, settings)
            prev_shape = next_shape = tensor_shape
            if cfg.variable_seq_lengths or getattr(cfg, "mtp_standalone", False):
                prev_shape, next_shape = self._communicate_shapes(
                    tensor_send_next, tensor_send_prev, recv_prev, recv_next
                )
            recv_prev_t = self._recv_buffer(prev_shape) if recv_prev else None
            recv_next_t = self._recv_buffer(next_shape) if recv_next else None
            post = self._post_mooncake if session.transport is not None else self._post_torch
            reqs = post(session, tensor_send_next, tensor_send_prev, recv_prev_t, recv_next_t)
            if wait_on_reqs and reqs:
                for req in reqs.values():
                    req.wait()
                reqs = None
            if cfg.batch_p2p_comm and cfg.batch_p2p_sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            return recv_prev_t, recv_next_t, reqs

        def _post_mooncake(self, session, send_next, send_prev, recv_prev, recv_next) -> dict:
            tr = session.transport
            reqs: dict[str, Any] = {}
            # Sends are staged (copied) at post time, so the caller may free them at once. The
            # ops of one call leave as one frame per peer (one control message per VPP step).
            with tr.batch():
                if send_next is not None:
                    reqs["send_next"] = tr.isend(send_next, self.next_rank, FWD)
                if send_prev is not None:
                    reqs["send_prev"] = tr.isend(send_prev, self.prev_rank, BWD)
                if recv_prev is not None:
                    reqs["recv_prev"] = tr.irecv(recv_prev, self.prev_rank, FWD)
                if recv_next is not None:
                    reqs["recv_next"] = tr.irecv(recv_next, self.next_rank, BWD)
            return reqs

        def _post_torch(self, session, send_next, send_prev, recv_prev, recv_next) -> dict:
            from megatron.core.pipeline_parallel import p2p_communication

            send_next, send_prev = alias(send_next), alias(send_prev)
            for received in (recv_prev, recv_next):  # counted at the receiver, as the reads are
                if received is not None:
                    effects.count("torch", received.numel() * received.element_size())
            kwargs = dict(
                tensor_send_prev=send_prev,
                tensor_recv_prev=recv_prev,
                tensor_send_next=send_next,
                tensor_recv_next=recv_next,
                group=self.pp_group,
                prev_pipeline_rank=self.prev_rank,
                next_pipeline_rank=self.next_rank,
            )
            timeout_s = session.settings.timeout_s
            if self.config.batch_p2p_comm:
                works = batched_p2p_ops_fixed(**kwargs, timeout_s=timeout_s)
                return {f"op{i}": w for i, w in enumerate(works)}
            # Upstream's unbatched ops are order-safe (separate groups per direction for PP=2);
            # only the send storage needs pinning.
            works = p2p_communication._p2p_ops(**kwargs)
            keep = {"send_next": (send_next,), "send_prev": (send_prev,)}
            return {n: HeldWork(w, keep.get(n, ()), timeout_s) for n, w in works.items()}

        def _communicate_shapes(
            self, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool, recv_next: bool
        ) -> tuple[list[int], list[int]]:
            """Upstream's shape exchange (``variable_seq_lengths``) with the PP=2-safe order."""
            device = _device()

            def shape_of(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else torch.tensor(t.size(), device=device)

            recv_prev_t = torch.empty(3, dtype=torch.int64, device=device) if recv_prev else None
            recv_next_t = torch.empty(3, dtype=torch.int64, device=device) if recv_next else None
            works = batched_p2p_ops_fixed(
                tensor_send_prev=shape_of(tensor_send_prev),
                tensor_recv_prev=recv_prev_t,
                tensor_send_next=shape_of(tensor_send_next),
                tensor_recv_next=recv_next_t,
                group=self.pp_group,
                prev_pipeline_rank=self.prev_rank,
                next_pipeline_rank=self.next_rank,
            )
            for work in works:
                work.wait()
            return (
                recv_prev_t.tolist() if recv_prev_t is not None else [0, 0, 0],
                recv_next_t.tolist() if recv_next_t is not None else [0, 0, 0],
            )

    _CLASSES[base] = PPRdmaP2PCommunicator
    return PPRdmaP2PCommunicator
