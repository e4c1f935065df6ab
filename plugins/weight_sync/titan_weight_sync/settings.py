"""weight_sync's knobs (``TITAN_WEIGHT_SYNC_*``): declared once, here, and read only through
``Setting.read()``; each side reads them once per endpoint into a :class:`WeightSyncSettings`."""

from __future__ import annotations

from typing import NamedTuple

from titan_plugins.settings import BYTES, Setting
from titan_plugins.transport.addresses import host_problem, nic_problem

PROTOCOLS = ("auto", "rdma", "tcp")

PROTOCOL = Setting(
    "TITAN_WEIGHT_SYNC_PROTOCOL",
    str,
    "auto",
    "Mooncake protocol of the weight writes: rdma | tcp | auto (rdma when an RDMA NIC is "
    "visible); trainer and engines must agree",
    choices=PROTOCOLS,
)
HOST = Setting(
    "TITAN_WEIGHT_SYNC_HOST",
    str,
    "",
    "address this process's Mooncake engine listens on and peers reach it on (empty: 127.0.0.1 "
    "for a local job, else the interface that routes to MASTER_ADDR)",
    validate=host_problem,
    default_text="(auto)",
)
DEVICE = Setting(
    "TITAN_WEIGHT_SYNC_DEVICE",
    str,
    "",
    "comma-separated RDMA NIC names for Mooncake (empty: auto)",
    validate=nic_problem,
    default_text="(auto)",
)
SECRET_FILE = Setting(
    "TITAN_WEIGHT_SYNC_SECRET_FILE",
    str,
    "",
    "file with the job's weight-sync secret (64 hex digits, mode 600); the trainer and every "
    "engine read the same file, and an engine accepts no trainer without it",
    default_text="(none: engines accept no trainer)",
)
STAGING_BYTES = Setting(
    "TITAN_WEIGHT_SYNC_STAGING_BYTES",
    BYTES,
    256 << 20,
    "the trainer's registered staging buffer (host memory, reserved in the core's ledger), "
    "used as two halves: one is written while the next piece is packed into the other; a "
    "tensor larger than a half goes in ranges; in an engine with tp_size > 1, the most that TP "
    "rank 0 sends the other ranks in one broadcast",
    minimum=1 << 16,
)
TIMEOUT_S = Setting(
    "TITAN_WEIGHT_SYNC_TIMEOUT_S",
    float,
    300.0,
    "seconds one engine call (pause, load, resume) may take before the sync fails",
    minimum=1.0,
    maximum=86400.0,
)

SGLANG_PYTHON = Setting(
    "TITAN_SGLANG_PYTHON",
    str,
    "",
    "the python of an SGLang venv that titan_weight_sync.cpu_engine starts CPU engines with "
    "(tests, benchmark)",
    default_text="(.venv-sglang of the checkout)",
)

SETTINGS = [PROTOCOL, HOST, DEVICE, SECRET_FILE, STAGING_BYTES, TIMEOUT_S, SGLANG_PYTHON]


class WeightSyncSettings(NamedTuple):
    """The knobs as one endpoint reads them (also what the core's Mooncake engine needs)."""

    protocol: str = "auto"
    host: str = ""
    device: str = ""
    secret_file: str = ""
    staging_bytes: int = 256 << 20
    timeout_s: float = 300.0
    metadata: str = "P2PHANDSHAKE"

    @classmethod
    def read(cls) -> WeightSyncSettings:
        """The current values (bad ones already reported by the core; defaults apply)."""
        return cls(
            protocol=PROTOCOL.read(),
            host=HOST.read(),
            device=DEVICE.read(),
            secret_file=SECRET_FILE.read(),
            staging_bytes=int(STAGING_BYTES.read()),
            timeout_s=TIMEOUT_S.read(),
        )
