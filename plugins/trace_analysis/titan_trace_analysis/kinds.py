"""Classify GPU and CPU events: compute, memory, or communication of a given kind.

Communication kernels are recognised by name for NCCL (``ncclKernel_*``, ``ncclDevKernel_*``
since NCCL 2.19, the older ``nccl<Coll>Kernel_*``), ROCm RCCL (which reuses NCCL's names, often
one ``ncclDevKernel_Generic`` for every collective) and Moore Threads' MCCL (``mcclKernel_*`` /
``mcclDevKernel_*``).  The kind comes, in order of trust, from PyTorch's collective args
(``Collective name``, process group), from the CPU-side profiling title around the launch
(``nccl:send 0->1``, ``nccl:all_to_all``, ``gloo:recv``, ``titan.p2p:recv_forward``), or from
the kernel name.  A ``SendRecv`` kernel known by name only is ``p2p``: pipeline or expert
traffic cannot be told apart without the args or the title.
"""

from __future__ import annotations

import re
from functools import lru_cache

COMM_NAME = re.compile(r"^(?:nccl|rccl|mccl)\w*Kernel|^(?:nccl|mccl|rccl)[A-Z]\w*(?:Kernel|_)")
MEMORY_NAME = re.compile(r"^(?:Memcpy|Memset|dma)")
CPU_COMM_NAME = re.compile(r"^(?:c10d::|record_param_comms$|(?:nccl|gloo|mccl|rccl|hccl):)")

COMPUTE, MEMORY, COMM = 0, 1, 2

PP_SEND, PP_RECV, EP_A2A = "pp_send", "pp_recv", "ep_a2a"
REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE = "dp_reduce_scatter", "dp_all_gather", "dp_all_reduce"
OTHER_COMM, P2P = "other_comm", "p2p"
COMM_KINDS = (PP_SEND, PP_RECV, EP_A2A, REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE, OTHER_COMM, P2P)

_BY_COLLECTIVE = (
    ("all_to_all", EP_A2A),
    ("alltoall", EP_A2A),
    ("reduce_scatter", REDUCE_SCATTER),
    ("reducescatter", REDUCE_SCATTER),
    ("all_gather", ALL_GATHER),
    ("allgather", ALL_GATHER),
    ("all_reduce", ALL_REDUCE),
    ("allreduce", ALL_REDUCE),
)
_BY_KERNEL = (
    ("alltoall", EP_A2A),
    ("reducescatter", REDUCE_SCATTER),
    ("allgather", ALL_GATHER),
    ("allreduce", ALL_REDUCE),
    ("sendrecv", P2P),
)
# PyTorch: "nccl:send 0->1" / "nccl:recv 1<-0" (peer known); gloo: "gloo:send" (no peer)
_TITLE = re.compile(r"^(?:nccl|gloo|mccl|rccl|hccl):(\w+)(?:\s+(\d+)\s*(->|<-)\s*(\d+))?")
# titan's capture: "titan.p2p:send_forward_recv_backward" around Megatron's P2PCommunicator calls
_SCHEDULE = re.compile(r"^titan\.p2p:(\w+)$")
Peer = int | str | None  # a rank, "prev" / "next" in the pipeline, or unknown


def kernel_class(name: str, cat: str) -> int:
    """COMPUTE, MEMORY or COMM for one GPU event (HTA's split, with modern NCCL/MCCL names)."""
    if cat != "kernel" or MEMORY_NAME.match(name):
        return MEMORY
    if COMM_NAME.match(name):
        return COMM
    return COMPUTE


# A rank's ~4k communication kernels and titles carry a few dozen distinct names: the two
# classifiers below are pure functions of their strings, so they are memoised (bounded).
@lru_cache(maxsize=4096)
def comm_kind(name: str, collective: str, pg_desc: str) -> str:
    """Kind of one communication op from its collective name, PG description and kernel name."""
    coll = collective.lower().lstrip("_")
    desc = pg_desc.lower()
    if coll in ("send", "isend"):
        return PP_SEND
    if coll in ("recv", "irecv", "recv_any_source"):
        return PP_RECV
    for key, kind in _BY_COLLECTIVE:
        if key in coll:
            return kind
    if "expert_model" in desc or desc.startswith("ep"):
        return EP_A2A
    low = name.lower()
    for key, kind in _BY_KERNEL:
        if key in low:
            return kind
    return OTHER_COMM


@lru_cache(maxsize=4096)
def title_parts(title: str) -> tuple[tuple[str, Peer], ...] | None:
    """(kind, peer) of each transfer a CPU-side communication title stands for, or None.

    ``send_forward_recv_backward`` is two transfers (send to next, receive from next).
    """
    m = _SCHEDULE.match(title)
    if m is not None:
        send_part, _, recv_part = m.group(1).partition("recv")
        parts: list[tuple[str, Peer]] = []
        if send_part.startswith("send"):
            if "forward" in send_part:
                parts.append((PP_SEND, "next"))
            if "backward" in send_part:
                parts.append((PP_SEND, "prev"))
        if "forward" in recv_part:
            parts.append((PP_RECV, "prev"))
        if "backward" in recv_part:
            parts.append((PP_RECV, "next"))
        return tuple(parts) or None
    m = _TITLE.match(title)
    if m is None:
        return None
    coll, a, arrow, b = m.groups()
    kind = comm_kind("", coll, "")
    peer: Peer = None
    if kind in (PP_SEND, PP_RECV) and arrow:
        peer = int(b)  # "r->peer" and "r<-peer" both name the peer second
    return ((kind, peer),)
