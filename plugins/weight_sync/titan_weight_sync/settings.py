"""weight_sync's knobs (``TITAN_WEIGHT_SYNC_*``): declared once, here, and read only through
``Setting.read()``; each side reads them once per endpoint into a :class:`WeightSyncSettings`.

Each knob's check is the whole check a value can have before it is used (the core runs it at
activation, and every read repeats it): the address resolves to one of this host's, every named
NIC exists when the protocol is rdma, the secret file is a regular owner-only file of 64 hex
digits. The plugin's own switch ``TITAN_WEIGHT_SYNC`` is read again by every sync
(:func:`sync_refusal`), so a trainer that uses :class:`~titan_weight_sync.trainer_side.WeightSync`
without ``import megatron`` (no activation) obeys it too.
"""

from __future__ import annotations

from typing import NamedTuple

from titan_plugins.settings import BYTES, STRICT_SUFFIX, Setting, SettingError, strict
from titan_plugins.switches import MASTER, plugin_switch
from titan_plugins.transport.addresses import absent_nic_problem, local_host_problem, nic_problem
from titan_plugins.transport.auth import SecretError, read_secret, secret_problem

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
    validate=local_host_problem,
    default_text="(auto)",
)


def _device_problem(value: str) -> str | None:
    """The names' form; under rdma (or auto, which means rdma where a NIC is visible) also
    that each NIC exists: Mooncake would otherwise fail at its first write, or use another."""
    problem = nic_problem(value)
    if problem:
        return problem
    protocol = PROTOCOL.default if PROTOCOL.problem() else PROTOCOL.read()
    return None if protocol == "tcp" else absent_nic_problem(value)


DEVICE = Setting(
    "TITAN_WEIGHT_SYNC_DEVICE",
    str,
    "",
    "comma-separated RDMA NIC names for Mooncake (empty: auto); each must exist on this host "
    "unless the protocol is tcp",
    validate=_device_problem,
    default_text="(auto)",
)
SECRET_FILE = Setting(
    "TITAN_WEIGHT_SYNC_SECRET_FILE",
    str,
    "",
    "file with the job's weight-sync secret (64 hex digits, mode 600); the trainer and every "
    "engine read the same file, and an engine accepts no trainer without it",
    validate=secret_problem,
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


SWITCH = plugin_switch("weight_sync")


def sync_refusal() -> str | None:
    """Why this process must not sync now, or None when it may: ``TITAN_PLUGINS=0`` or
    ``TITAN_WEIGHT_SYNC=0`` (read at every sync, as the core reads them at activation), or a
    value of either that is no switch value (refused rather than guessed: ``-1`` or ``abc``
    may have meant off).

    :raises SettingError: a bad value under ``TITAN_PLUGINS_STRICT=1``.
    """
    for switch in (MASTER, SWITCH):
        problem = switch.problem()
        if problem:
            if strict():
                raise SettingError(problem + STRICT_SUFFIX)
            return f"{problem}; weight_sync does not sync until it is 1 (on) or 0 (off)"
        if not switch.read():
            return (
                f"{switch.name}=0 turns weight_sync off: this process does not sync "
                "(unset it, or set it to 1, to sync)"
            )
    return None


def job_secret(path: str) -> bytes:
    """The job's secret from ``path`` (a :class:`WeightSyncSettings`' ``secret_file``).

    :raises SecretError: the file's problem; for an empty ``path`` while the variable is set,
        the problem that made the read fall back to "none" (not a misleading "is not set").
    """
    if not path and SECRET_FILE.is_set():
        problem = SECRET_FILE.problem()
        if problem:
            raise SecretError(problem)
        path = SECRET_FILE.read()  # made good since the settings were read
    return read_secret(path, SECRET_FILE.name)
