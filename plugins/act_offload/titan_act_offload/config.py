"""The plugin's knobs (``TITAN_ACT_OFFLOAD_*``), read lazily from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Blocks whose saved tensors can be offloaded; each maps to the megatron-core forward it wraps.
MODULES = ("attention", "mlp", "moe", "experts", "layer")
DEFAULT_MODULES = ("attention", "mlp", "moe")
DEFAULT_MIN_BYTES = 64 << 10
HOST_FRACTION = 0.4  # default host budget: this share of physical RAM, split over local ranks

PREFIX = "TITAN_ACT_OFFLOAD"


def default_host_budget() -> int:
    """40% of physical memory divided by the local world size (``LOCAL_WORLD_SIZE``)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 64 << 30
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(total * HOST_FRACTION) // local


@dataclass(frozen=True)
class OffloadConfig:
    """Resolved settings.

    :param modules: blocks whose saved tensors are offloaded (see :data:`MODULES`).
    :param min_gap: offload a microbatch only if at least this many schedule steps run between
        its forward and its backward (0 also offloads a microbatch whose backward follows at once).
    :param min_bytes: tensors smaller than this stay on the device.
    :param max_host_bytes: host buffer budget; past it activations stay on the device.
    :param prefetch_blocks: blocks brought back ahead of the one backward is using.
    :param dry_run: account saved bytes but copy nothing (the no-offload baseline).
    """

    modules: tuple[str, ...] = DEFAULT_MODULES
    min_gap: int = 1
    min_bytes: int = DEFAULT_MIN_BYTES
    max_host_bytes: int | None = None
    prefetch_blocks: int = 1
    dry_run: bool = False

    @classmethod
    def from_env(cls) -> OffloadConfig:
        """Read every ``TITAN_ACT_OFFLOAD_*`` knob (bad values warn and fall back)."""
        from titan_plugins.settings import complain, env_bool, env_bytes, env_int, env_list

        modules = env_list(f"{PREFIX}_MODULES", DEFAULT_MODULES)
        unknown = [m for m in modules if m not in MODULES]
        if unknown:
            complain(
                f"{PREFIX}_MODULES: unknown block(s) {', '.join(unknown)}; choose from "
                f"{', '.join(MODULES)} (unknown names ignored)"
            )
            modules = tuple(m for m in modules if m in MODULES)
        budget = env_bytes(f"{PREFIX}_MAX_HOST_BYTES", None)
        return cls(
            modules=modules,
            min_gap=env_int(f"{PREFIX}_MIN_GAP", 1, minimum=0),
            min_bytes=env_bytes(f"{PREFIX}_MIN_BYTES", DEFAULT_MIN_BYTES) or 0,
            max_host_bytes=budget if budget else default_host_budget(),
            prefetch_blocks=env_int(f"{PREFIX}_PREFETCH_BLOCKS", 1, minimum=1),
            dry_run=env_bool(f"{PREFIX}_DRY_RUN", False),
        )


def settings() -> list:
    """The knobs as core ``Setting`` records (for ``titan-plugins env`` and the README)."""
    from titan_plugins.settings import Setting

    return [
        Setting(
            f"{PREFIX}_MODULES",
            ",".join(DEFAULT_MODULES),
            "blocks whose saved activations are offloaded (comma list)",
            MODULES,
        ),
        Setting(
            f"{PREFIX}_MIN_GAP",
            "1",
            "offload a microbatch if at least this many schedule steps separate its "
            "forward and backward",
        ),
        Setting(f"{PREFIX}_MIN_BYTES", "64K", "smaller saved tensors stay on the device"),
        Setting(
            f"{PREFIX}_MAX_HOST_BYTES",
            "0 (auto: 40% of RAM / local ranks)",
            "host buffer budget (e.g. 512M, 4G); past it offloading stops with a warning",
        ),
        Setting(f"{PREFIX}_PREFETCH_BLOCKS", "1", "blocks reloaded ahead of backward"),
        Setting(f"{PREFIX}_DRY_RUN", "0", "account saved bytes without copying (baseline)"),
    ]
