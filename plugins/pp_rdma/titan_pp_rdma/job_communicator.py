"""The P2P communicator a job hands to megatron's schedules itself.

The class patch reaches the communicator the schedules build when they get none
(``schedules.py``: ``P2PCommunicator(pp_group=..., config=...)``). A job may pass its own through
the schedules' ``p2p_communicator`` argument, and megatron-core 0.19's ``pretrain`` /
``train_step`` thread one there (``pretrain(p2p_communicator=...)``): that object never passes
through the patched name. Upstream's own class is then served as the schedules' would be: the
call gets a pp_rdma communicator with the same state (pipeline group, config, peer ranks). Any
other class (a subclass of the job's, 0.19's ``MultiModulePipelineCommunicator``) is the job's
choice: it is left alone and reported, never silently bypassed.
"""

from __future__ import annotations

import threading
from typing import Any

SHORT = "own p2p_communicator"
_LOCK = threading.Lock()
_FOREIGN: dict[str, int] = {}  # class of the job's communicators left alone -> schedule calls
_SERVED = [0]  # schedule calls whose upstream-class communicator pp_rdma served


def adopt(kwargs: dict[str, Any]) -> None:
    """Before a schedule call: serve the communicator in ``kwargs`` if it is upstream's class
    (replaced for this call), or record that the job's own class carries the transfers."""
    comm = kwargs.get("p2p_communicator")
    if comm is None or getattr(comm, "titan_plugin", None) == "pp_rdma":
        return
    from megatron.core.pipeline_parallel import p2p_communication

    from titan_pp_rdma.communicator import build_communicator_class

    upstream = p2p_communication.P2PCommunicator
    if type(comm) is upstream:
        cls = build_communicator_class(upstream)
        ours = cls.__new__(cls)
        ours.__dict__.update(comm.__dict__)  # same groups, config and ranks; nothing recomputed
        kwargs["p2p_communicator"] = ours
        with _LOCK:
            _SERVED[0] += 1
        return
    name = f"{type(comm).__module__}.{type(comm).__qualname__}"
    with _LOCK:
        _FOREIGN[name] = _FOREIGN.get(name, 0) + 1


def foreign() -> dict[str, int]:
    """The job's own communicator classes pp_rdma left alone, with the schedule calls each."""
    with _LOCK:
        return dict(_FOREIGN)


def served() -> int:
    """Schedule calls whose job-passed communicator (upstream's class) pp_rdma served."""
    with _LOCK:
        return _SERVED[0]


def reason() -> str:
    """Why pipeline transfers did not go through pp_rdma (empty when no job class was seen)."""
    seen = foreign()
    if not seen:
        return ""
    names = ", ".join(f"{name} ({calls} schedule calls)" for name, calls in seen.items())
    return (
        f"the job passed its own p2p_communicator to the schedules: {names}; its transfers "
        "are its own. To carry them over pp_rdma, build that communicator from the class the "
        "titan_p2p_communicator hook returns (titan_pp_rdma.communicator."
        "build_communicator_class(P2PCommunicator)), or pass none and let the schedules build it"
    )


def reset() -> None:
    """Forget what was seen (tests)."""
    with _LOCK:
        _FOREIGN.clear()
        _SERVED[0] = 0
