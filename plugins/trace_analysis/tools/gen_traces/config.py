"""The generator's configuration (one object shared by the simulator and every lane)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Config:
    """What to simulate and how to write it.  Times are in microseconds."""

    out: str
    pp: int
    dp: int
    ep: int
    layers: int
    microbatches: int
    steps: int
    first_step: int = 10
    slow_ranks: set[int] = field(default_factory=set)
    slow_factor: float = 1.3
    a2a_us: float = 450.0
    p2p_us: float = 300.0
    dp_us: float = 4000.0
    buckets: int = 4
    adam_kernels: int = 12
    naming: str = "modern"  # modern | legacy | rccl | mccl (see catalogue.NAMINGS)
    collective_args: bool = True  # PyTorch's "Collective name", process group, ... on kernels
    annotations: bool = True  # CPU-side "nccl:send 0->1" profiling titles around launches
    ranks_per_node: int = 0  # > 0: write Kineto's "host_name" (node-<rank // ranks_per_node>)
    rank_in_header: bool = True  # False: distributedInfo without "rank" (older exports)
    cuda_sync: bool = True
    fwdbwd: bool = True
    gzip: bool = True
    seed: int = 0
    base: float = 5_000_000_000.0  # first CPU timestamp
