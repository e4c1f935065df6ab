"""The plugin's knobs (``TITAN_ACT_OFFLOAD_*``), declared once and read through ``Setting.read``.

Light on purpose: the core reads :data:`SETTINGS` at activation, while Megatron is importing.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from titan_plugins.settings import BYTES, Setting

# Blocks whose saved tensors can be offloaded; each maps to the megatron-core forwards it wraps.
MODULES = ("attention", "mlp", "moe", "experts", "layer")
HOST_FRACTION = 0.4  # default host budget: this share of physical RAM, split over local ranks

MODULES_SETTING = Setting(
    "TITAN_ACT_OFFLOAD_MODULES",
    list,
    ("attention", "mlp", "moe"),
    "blocks whose saved activations are offloaded (comma list)",
    choices=MODULES,
)
MIN_GAP = Setting(
    "TITAN_ACT_OFFLOAD_MIN_GAP",
    int,
    1,
    "offload a microbatch if at least this many schedule steps separate its forward and "
    "backward (0: also microbatches whose backward follows at once)",
    minimum=0,
)
MIN_BYTES = Setting(
    "TITAN_ACT_OFFLOAD_MIN_BYTES",
    BYTES,
    None,
    "fixed size threshold: smaller saved tensors stay on the device (unset: the relative "
    "rule of TITAN_ACT_OFFLOAD_KEEP_FRACTION)",
    default_text="auto",
)
KEEP_FRACTION = Setting(
    "TITAN_ACT_OFFLOAD_KEEP_FRACTION",
    float,
    0.02,
    "without MIN_BYTES: the smallest saved tensors of each block stay on the device as long as "
    "together they are at most this fraction of the block's saved bytes",
    minimum=0.0,
    maximum=0.5,
)
MAX_HOST_BYTES = Setting(
    "TITAN_ACT_OFFLOAD_MAX_HOST_BYTES",
    BYTES,
    None,
    "host buffer budget (e.g. 512M, 4G); past it activations stay on the device with a warning",
    minimum=1,
    default_text="auto: 40% of RAM / LOCAL_WORLD_SIZE",
)
PREFETCH_BLOCKS = Setting(
    "TITAN_ACT_OFFLOAD_PREFETCH_BLOCKS",
    int,
    1,
    "blocks reloaded ahead of the one backward is reading",
    minimum=1,
)
DRY_RUN = Setting(
    "TITAN_ACT_OFFLOAD_DRY_RUN",
    bool,
    False,
    "account saved bytes without copying (the no-offload baseline)",
)

SETTINGS = [
    MODULES_SETTING,
    MIN_GAP,
    MIN_BYTES,
    KEEP_FRACTION,
    MAX_HOST_BYTES,
    PREFETCH_BLOCKS,
    DRY_RUN,
]


def default_host_budget() -> int:
    """40% of physical memory divided by the local world size (``LOCAL_WORLD_SIZE``)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 64 << 30
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:  # the launcher's variable, not ours: a bad value means one rank
        local = 1
    return int(total * HOST_FRACTION) // local


class OffloadSettings(NamedTuple):
    """Resolved knob values of one activation.

    :param modules: blocks whose saved tensors are offloaded (see :data:`MODULES`).
    :param min_gap: offload a microbatch only if at least this many schedule steps run between
        its forward and its backward (0 also offloads a microbatch whose backward follows at once).
    :param min_bytes: fixed threshold (tensors smaller stay on the device), or None for the
        relative rule of ``keep_fraction``.
    :param keep_fraction: relative rule: per block, the smallest tensors stay while they sum to
        at most this fraction of the block's saved bytes.
    :param max_host_bytes: host buffer budget; past it activations stay on the device.
    :param prefetch_blocks: blocks brought back ahead of the one backward is using.
    :param dry_run: account saved bytes but copy nothing (the no-offload baseline).
    """

    modules: tuple[str, ...] = ("attention", "mlp", "moe")
    min_gap: int = 1
    min_bytes: int | None = None
    keep_fraction: float = 0.02
    max_host_bytes: int | None = None
    prefetch_blocks: int = 1
    dry_run: bool = False

    @classmethod
    def from_env(cls) -> OffloadSettings:
        """Read every ``TITAN_ACT_OFFLOAD_*`` knob (bad values warn and use the default)."""
        return cls(
            modules=tuple(dict.fromkeys(MODULES_SETTING.read())),
            min_gap=MIN_GAP.read(),
            min_bytes=MIN_BYTES.read(),
            keep_fraction=KEEP_FRACTION.read(),
            max_host_bytes=MAX_HOST_BYTES.read() or default_host_budget(),
            prefetch_blocks=PREFETCH_BLOCKS.read(),
            dry_run=DRY_RUN.read(),
        )

    def as_dict(self) -> dict[str, object]:
        """For reports."""
        return {
            "modules": list(self.modules),
            "min_gap": self.min_gap,
            "min_bytes": "auto" if self.min_bytes is None else self.min_bytes,
            "keep_fraction": self.keep_fraction,
            "max_host_bytes": self.max_host_bytes,
            "prefetch_blocks": self.prefetch_blocks,
            "dry_run": self.dry_run,
        }
