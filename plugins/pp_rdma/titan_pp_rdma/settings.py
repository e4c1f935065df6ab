"""The plugin's environment knobs (``TITAN_PP_RDMA_*``): declared once, read through ``.read()``.

The core checks them at activation (a bad value is an error under ``TITAN_PLUGINS_STRICT=1``, a
warning naming the variable, the value and what is accepted otherwise, and the default is used).
The session reads them once per communicator into a :class:`PPRdmaSettings`.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit

from titan_plugins.settings import BYTES, Setting
from titan_plugins.transport.addresses import host_problem, nic_problem

BACKENDS = ("auto", "mooncake", "torch")
PROTOCOLS = ("auto", "rdma", "tcp")
BUFFERS = ("auto", "ring", "direct")
METADATA_SCHEMES = ("etcd", "redis", "http", "https")


def _check_metadata(value: str) -> str | None:
    if value == "P2PHANDSHAKE":
        return None
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in METADATA_SCHEMES or not parts.hostname or port is None:
        return (
            "expected P2PHANDSHAKE or a metadata server URL with host and port: etcd://h:p, "
            "redis://h:p or http://h:p/metadata"
        )
    return None


BACKEND = Setting(
    "TITAN_PP_RDMA_BACKEND",
    str,
    "auto",
    "mooncake | torch | auto (Mooncake when importable, else torch.distributed P2P)",
    choices=BACKENDS,
)
PROTOCOL = Setting(
    "TITAN_PP_RDMA_PROTOCOL",
    str,
    "auto",
    "Mooncake protocol: rdma | tcp | auto (rdma when an RDMA NIC is visible)",
    choices=PROTOCOLS,
)
METADATA = Setting(
    "TITAN_PP_RDMA_METADATA",
    str,
    "P2PHANDSHAKE",
    "P2PHANDSHAKE (no server) or a metadata server: etcd://h:p, redis://h:p, http://h:p/metadata",
    validate=_check_metadata,
)
DEVICE = Setting(
    "TITAN_PP_RDMA_DEVICE",
    str,
    "",
    "comma-separated RDMA NIC names for Mooncake (empty: auto)",
    validate=nic_problem,
    default_text="(auto)",
)
HOST = Setting(
    "TITAN_PP_RDMA_HOST",
    str,
    "",
    "address peers reach this rank on, and the only one pp_rdma and Mooncake listen on (empty: "
    "127.0.0.1 for a local job, else the interface that routes to MASTER_ADDR)",
    validate=host_problem,
    default_text="(auto)",
)
TIMEOUT_S = Setting(
    "TITAN_PP_RDMA_TIMEOUT_S",
    float,
    300.0,
    "seconds before a missing peer / transfer raises instead of waiting",
    minimum=0.1,
    maximum=86400.0,
)
BUFFERS_KNOB = Setting(
    "TITAN_PP_RDMA_BUFFERS",
    str,
    "auto",
    "ring: registered slots per (peer, direction, shape, dtype) reused across microbatches, one "
    "copy per side (RDMA default); direct: register the tensors themselves, no copy (TCP "
    "default)",
    choices=BUFFERS,
)
INLINE_BYTES = Setting(
    "TITAN_PP_RDMA_INLINE_BYTES",
    BYTES,
    64 << 10,
    "CPU tensors up to this size travel inside their announce on the control connection "
    "instead of a Mooncake transfer (0: never)",
    minimum=0,
    maximum=1 << 20,
)
SPIN_US = Setting(
    "TITAN_PP_RDMA_SPIN_US",
    float,
    100.0,
    "microseconds a wait for an incoming tensor checks its sockets before it sleeps (0: sleep "
    "at once); where a sleep and wake-up cost more CPU than this (VMs), a message that comes "
    "sooner is taken without one",
    minimum=0.0,
    maximum=10000.0,
)
SETTINGS = [
    BACKEND,
    PROTOCOL,
    METADATA,
    DEVICE,
    HOST,
    TIMEOUT_S,
    BUFFERS_KNOB,
    INLINE_BYTES,
    SPIN_US,
]


class PPRdmaSettings(NamedTuple):
    """Resolved knobs for one transport session (compared to decide whether to reopen it)."""

    backend: str = "auto"
    protocol: str = "auto"
    metadata: str = "P2PHANDSHAKE"
    device: str = ""
    host: str = ""
    timeout_s: float = 300.0
    buffers: str = "auto"
    inline_bytes: int = 64 << 10
    spin_us: float = 100.0

    @classmethod
    def from_env(cls) -> PPRdmaSettings:
        """Read every ``TITAN_PP_RDMA_*`` knob (a malformed value warns and uses the default)."""
        return cls(
            backend=BACKEND.read(),
            protocol=PROTOCOL.read(),
            metadata=METADATA.read(),
            device=DEVICE.read(),
            host=HOST.read(),
            timeout_s=TIMEOUT_S.read(),
            buffers=BUFFERS_KNOB.read(),
            inline_bytes=INLINE_BYTES.read(),
            spin_us=SPIN_US.read(),
        )
