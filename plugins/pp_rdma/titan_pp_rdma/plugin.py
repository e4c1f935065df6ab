"""pp_rdma hook implementations (the ``titan_plugins`` entry point).

Two patches, on every supported megatron-core line (0.16-0.19: the targets are unchanged):
- ``schedules.P2PCommunicator`` -> a subclass whose ``_communicate`` sends over Mooncake Transfer
  Engine (torch.distributed fallback), so the unmodified schedules build it every step.
- ``p2p_communication._batched_p2p_ops`` -> the same ops in an order that is correct when the
  previous and next stage are one rank (PP=2 + VPP), for code that builds upstream's class itself.
And a train-step wrapper for the communicator a job passes to the schedules itself (0.19's
``pretrain(p2p_communicator=...)``), which the class patch never sees (``job_communicator``).
megatron is never imported here at module import time.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.patching import Patch, Signature


def _communicator_factory(original: Any) -> Any:
    from titan_pp_rdma.communicator import build_communicator_class

    return build_communicator_class(original)


def _batched_ops_factory(original: Any) -> Any:
    from titan_pp_rdma.torch_p2p import batched_p2p_ops_fixed

    return batched_p2p_ops_fixed


# What the subclass overrides and reads in megatron's P2PCommunicator.
COMMUNICATOR = Signature(
    of="P2PCommunicator._communicate",
    params=("self", "tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next")
    + ("tensor_shape", "wait_on_reqs"),
    attrs=("P2PCommunicator._communicate_shapes",),
)
COMMUNICATOR_STATE = Signature(
    of="P2PCommunicator.__init__", contains=("self.pp_group", "self.config")
)
# The fixed op order posts every op on the pipeline group, as upstream does (slime's and
# miles-rl's copies drop ``group``: replacing theirs would change which group carries the ops).
BATCHED_OPS = Signature(
    params=("tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next")
    + ("group", "prev_pipeline_rank", "next_pipeline_rank"),
    contains=("tensor_send_prev, prev_pipeline_rank, group",),
)


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Swap the pipeline P2P communicator and fix the batched op order."""
    register(
        Patch(
            id="pp_rdma.p2p_communicator",
            target="megatron.core.pipeline_parallel.schedules:P2PCommunicator",
            replace=_communicator_factory,
            requires=SUPPORTED_MEGATRON,
            signature=(COMMUNICATOR, COMMUNICATOR_STATE),
            rationale="route pipeline send/recv through Mooncake Transfer Engine (RDMA/TCP) with "
            "registered, reused buffers; pin send storage until completion; per-direction "
            "matching so PP=2+VPP cannot swap activations and gradients",
            upstream="megatron/core/pipeline_parallel/schedules.py:15,861,2010 build the class "
            "from this module global when no p2p_communicator is passed (megatron.training never "
            "passes one)",
            remove_when="megatron-core ships a pluggable P2P transport and fixes "
            "NVIDIA/Megatron-LM #750/#1450 and the in-flight free of deallocate_output_tensor",
            rebind_aliases=False,
        )
    )
    register(
        Patch(
            id="pp_rdma.batched_p2p_order",
            target="megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops",
            replace=_batched_ops_factory,
            requires=SUPPORTED_MEGATRON,
            signature=BATCHED_OPS,
            rationale="upstream posts [send_prev, recv_prev, send_next, recv_next]; with PP=2 "
            "prev == next and FIFO matching swaps activations and gradients under VPP",
            upstream="megatron/core/pipeline_parallel/p2p_communication.py:16-51; "
            "NVIDIA/Megatron-LM #750, #1450",
            remove_when="upstream posts sends [next, prev] and receives [prev, next]",
            rebind_aliases=False,
        )
    )


@hookimpl(wrapper=True)
def titan_train_step(step: Any) -> Generator[None, Any, Any]:
    """Serve (upstream's class) or report (another class) a communicator the job passed."""
    if step.kwargs.get("p2p_communicator") is not None:
        from titan_pp_rdma.job_communicator import adopt

        adopt(step.kwargs)
    return (yield)


@hookimpl
def titan_settings() -> list[Any]:
    """The ``TITAN_PP_RDMA_*`` knobs."""
    from titan_pp_rdma.settings import SETTINGS

    return list(SETTINGS)


@hookimpl
def titan_p2p_communicator(config: Any) -> Any | None:
    """The pp_rdma ``P2PCommunicator`` class (built on megatron's, imported lazily)."""
    from megatron.core.pipeline_parallel import p2p_communication

    from titan_pp_rdma.communicator import build_communicator_class

    base = p2p_communication.P2PCommunicator
    # The class patch may already have wrapped it; never subclass our own class twice.
    if getattr(base, "titan_plugin", None) == "pp_rdma":
        return base
    return build_communicator_class(base)


@hookimpl
def titan_report() -> dict[str, Any]:
    """Which transport is active (per the last pipeline session) and why."""
    from titan_pp_rdma.report import report

    return report()


@hookimpl
def titan_effects() -> dict[str, Any]:
    """Pipeline tensors received here, by path: ``read`` (one-sided Mooncake reads), ``inline``
    (small CPU tensors inside the authenticated control frame), ``torch`` (fallback); when none
    moved because the job's own communicator class carried them, ``stepped_aside`` says so."""
    from titan_pp_rdma import job_communicator
    from titan_pp_rdma.effects import effects

    moved = effects()
    if not moved and job_communicator.foreign():
        return {"stepped_aside": job_communicator.SHORT}
    return moved


@hookimpl
def titan_doctor() -> list[Any]:
    """Mooncake importable, protocol/NIC, metadata mode, and what the fallback would be."""
    from titan_pp_rdma.report import doctor_checks

    return doctor_checks()
