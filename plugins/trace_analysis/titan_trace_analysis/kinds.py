"""Classify GPU events: compute, memory, or communication of a given kind.

Communication kernels are recognised by name for NCCL (legacy ``ncclKernel_*`` and, since
NCCL 2.19, ``ncclDevKernel_*``), RCCL and Moore Threads' MCCL (``mcclKernel_*`` /
``mcclDevKernel_*``); the kind comes from PyTorch's collective args (``Collective name``,
``Process Group Description``) when present, else from the kernel name.
"""

from __future__ import annotations

import re

COMM_NAME = re.compile(r"^(?:nccl|rccl|mccl)\w*Kernel|^(?:nccl|mccl)[A-Z]\w*(?:Kernel|_)")
MEMORY_NAME = re.compile(r"^(?:Memcpy|Memset|dma)")

COMPUTE, MEMORY, COMM = 0, 1, 2

PP_SEND, PP_RECV, EP_A2A = "pp_send", "pp_recv", "ep_a2a"
REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE = "dp_reduce_scatter", "dp_all_gather", "dp_all_reduce"
OTHER_COMM = "other_comm"
COMM_KINDS = (PP_SEND, PP_RECV, EP_A2A, REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE, OTHER_COMM)

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
)


def kernel_class(name: str, cat: str) -> int:
    """COMPUTE, MEMORY or COMM for one GPU event (HTA's split, with modern NCCL/MCCL names)."""
    if cat != "kernel" or MEMORY_NAME.match(name):
        return MEMORY
    if COMM_NAME.match(name):
        return COMM
    return COMPUTE


def comm_kind(name: str, collective: str, pg_desc: str) -> str:
    """Kind of one communication kernel from its collective name, PG description and name."""
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
