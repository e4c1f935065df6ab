"""The plugin's environment knobs (``TITAN_PP_RDMA_*``), read lazily at session setup."""

from __future__ import annotations

import os
from dataclasses import dataclass

from titan_plugins.settings import Setting, env_choice, env_float

BACKENDS = ("auto", "mooncake", "torch")
PROTOCOLS = ("auto", "rdma", "tcp")
BUFFERS = ("auto", "ring", "direct")


@dataclass(frozen=True)
class PPRdmaSettings:
    """Resolved knobs for one transport session."""

    backend: str = "auto"
    protocol: str = "auto"
    metadata: str = "P2PHANDSHAKE"
    device: str = ""
    host: str = ""
    timeout_s: float = 300.0
    buffers: str = "auto"

    @classmethod
    def from_env(cls) -> PPRdmaSettings:
        """Read every ``TITAN_PP_RDMA_*`` knob (a malformed value warns and uses the default)."""
        return cls(
            backend=env_choice("TITAN_PP_RDMA_BACKEND", BACKENDS, "auto"),
            protocol=env_choice("TITAN_PP_RDMA_PROTOCOL", PROTOCOLS, "auto"),
            metadata=os.environ.get("TITAN_PP_RDMA_METADATA", "").strip() or "P2PHANDSHAKE",
            device=os.environ.get("TITAN_PP_RDMA_DEVICE", "").strip(),
            host=os.environ.get("TITAN_PP_RDMA_HOST", "").strip(),
            timeout_s=env_float("TITAN_PP_RDMA_TIMEOUT_S", 300.0, minimum=0.1),
            buffers=env_choice("TITAN_PP_RDMA_BUFFERS", BUFFERS, "auto"),
        )


def declared() -> list[Setting]:
    """The knobs as ``Setting`` records (for ``titan-plugins env`` and the README)."""
    return [
        Setting(
            var="TITAN_PP_RDMA_BACKEND",
            default="auto",
            doc="mooncake | torch | auto (Mooncake when importable, else torch.distributed P2P)",
            choices=BACKENDS,
        ),
        Setting(
            var="TITAN_PP_RDMA_PROTOCOL",
            default="auto",
            doc="Mooncake protocol: rdma | tcp | auto (rdma when an RDMA NIC is visible)",
            choices=PROTOCOLS,
        ),
        Setting(
            var="TITAN_PP_RDMA_METADATA",
            default="P2PHANDSHAKE",
            doc="P2PHANDSHAKE (no server) or etcd://h:p, redis://h:p, http://h:p/metadata",
        ),
        Setting(
            var="TITAN_PP_RDMA_DEVICE",
            default="",
            doc="comma-separated RDMA NIC names for Mooncake (empty: auto)",
        ),
        Setting(
            var="TITAN_PP_RDMA_HOST",
            default="",
            doc="address peers reach this rank on (empty: 127.0.0.1 for a local job, else the "
            "interface that routes to MASTER_ADDR)",
        ),
        Setting(
            var="TITAN_PP_RDMA_TIMEOUT_S",
            default="300",
            doc="seconds before a missing peer / transfer raises instead of waiting",
        ),
        Setting(
            var="TITAN_PP_RDMA_BUFFERS",
            default="auto",
            doc="ring: registered slots per (peer, direction, shape, dtype) reused across "
            "microbatches, one copy per side (RDMA default); direct: register the tensors "
            "themselves, no copy (TCP default)",
            choices=BUFFERS,
        ),
    ]
