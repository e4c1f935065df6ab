"""Hook implementations of trace_analysis (the entry-point target).

Import-light: only the standard library and the core are imported here (the capture module
imports torch inside functions); nothing touches megatron until the core's train-step hook
fires or a patch factory runs after ``megatron.core.pipeline_parallel.p2p_communication``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON
from titan_plugins.patching import Patch, Signature
from titan_plugins.settings import Setting

from . import capture
from .settings import SETTINGS

P2P = "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator"
# The schedules' only path to pipeline transfers; pp_rdma subclasses the class but inherits these
P2P_METHODS = (
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
)


@hookimpl(wrapper=True)
def titan_train_step(step: Any) -> Generator[None, Any, Any]:
    """Open iteration N of the capture (TITAN_TRACE_STEPS) before each training call."""
    capture.on_train_step(step.forward_only)
    return (yield)


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Title Megatron's P2P calls while a capture records (direction of every transfer)."""
    for method in P2P_METHODS:
        register(
            Patch(
                id=f"trace_analysis.p2p.{method}",
                target=f"{P2P}.{method}",
                replace=capture.wrap_p2p,
                requires=SUPPORTED_MEGATRON,
                # the wrapper passes every argument through; only the method must be there
                signature=Signature(positional=("self",)),
                rationale="name each pipeline transfer in the trace (titan.p2p:<method>) so the "
                "analyzer knows its direction and peer without collective args, and on CPU "
                "runs where P2P launches no kernel",
                upstream="megatron/core/pipeline_parallel/p2p_communication.py P2PCommunicator: "
                "the schedules call these methods for every pipeline send / receive",
                remove_when="megatron-core labels its P2P calls in the profiler (record_function "
                "around P2PCommunicator methods)",
            )
        )


@hookimpl
def titan_settings() -> list[Setting]:
    """Capture knobs (analysis options are command-line flags of titan-trace)."""
    return list(SETTINGS)


@hookimpl
def titan_report() -> dict[str, Any]:
    """Capture state for `titan-plugins list`."""
    try:
        cap = capture.current()
    except Exception as exc:  # a report must not fail (e.g. a bad value under STRICT)
        return {"capture": f"error: {exc}"}
    if cap is None:
        return {"capture": "off (TITAN_TRACE_STEPS unset)"}
    return {
        "capture": f"iterations {cap.first}-{cap.last}",
        "dir": cap.out_dir,
        "written": cap.path or "",
    }


@hookimpl
def titan_effects() -> dict[str, Any]:
    """What the capture did in this process: trace files written and iterations recorded."""
    cap = capture.existing()
    if cap is None:
        return {}
    return {"trace_files_written": int(cap.path is not None), "traced_iterations": cap.traced}
