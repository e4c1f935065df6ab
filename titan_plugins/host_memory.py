"""One ledger of the host memory the plugins hold in this process, under one shared limit.

Several plugins park data in host RAM: act_offload's activation pool, rewind's snapshots, and
the next one will too. Each has its own budget knob, but they share one machine: two defaults
that are each reasonable can together exhaust it (8 ranks per node, each with a pool and two
snapshots). The contract: a plugin reserves host bytes here before it allocates them, releases
them when it frees them, and takes a refusal as "keep the data on the device" / "no snapshot",
with its own clear warning, which :func:`shortfall` words (sizes readable and exact, the knob
that raises the limit, who holds the rest). ``TITAN_PLUGINS_MAX_HOST_BYTES`` caps the sum; the
default is 60% of physical memory divided by the local ranks.
"""

from __future__ import annotations

import os
import threading
import weakref

from titan_plugins.settings import BYTES, Setting, describe_bytes, format_bytes

SHARE_OF_RAM = 0.6

MAX_HOST_BYTES = Setting(
    "TITAN_PLUGINS_MAX_HOST_BYTES",
    BYTES,
    None,
    "host memory all plugins together may hold per process (offloaded activations, snapshots); "
    "past it a plugin keeps data on the device or skips its snapshot, with a warning",
    minimum=1,
    default_text="auto: 60% of RAM / local ranks",
)

_LOCK = threading.Lock()
_HELD: dict[str, int] = {}


def physical_memory() -> int:
    """Bytes of physical memory (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def local_ranks() -> int:
    """Ranks sharing this machine (``LOCAL_WORLD_SIZE`` from torchrun; 1 when absent or bad)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:  # the launcher's variable, not ours: a bad value means one rank
        return 1


def limit() -> int:
    """The shared limit in bytes for this process."""
    explicit = MAX_HOST_BYTES.read()
    if explicit:
        return int(explicit)
    return int((physical_memory() or 64 << 30) * SHARE_OF_RAM) // local_ranks()


def limit_text() -> str:
    """The shared limit as a message names it: the knob and its value, or how the default was
    computed (``TITAN_PLUGINS_MAX_HOST_BYTES unset: 60% of RAM / 8 local ranks = 9.6 GiB ...``)."""
    explicit = MAX_HOST_BYTES.read()
    if explicit:
        return f"{MAX_HOST_BYTES.name}={format_bytes(explicit)}"
    ranks = local_ranks()
    return (
        f"the shared limit ({MAX_HOST_BYTES.name} unset: {SHARE_OF_RAM:.0%} of RAM / {ranks} "
        f"local rank{'s' if ranks != 1 else ''} = {describe_bytes(limit())})"
    )


def held_text() -> str:
    """Who holds what, readable and exact: ``act_offload 48 KiB (49,152 bytes), rewind ...``."""
    held = {k: v for k, v in usage().items() if k not in ("total", "limit")}
    return ", ".join(f"{owner} {describe_bytes(n)}" for owner, n in sorted(held.items())) or "none"


def shortfall(nbytes: int) -> str:
    """Why reserving ``nbytes`` more is refused, for the refused plugin's warning: the sizes
    once each, readable and exact, the knob that raises the limit, and who holds the rest.

    ``need 9.85 MiB (10,328,280 bytes) but only 16 KiB (16,384 bytes) of
    TITAN_PLUGINS_MAX_HOST_BYTES=64K remain (held: act_offload 48 KiB (49,152 bytes)); raise
    TITAN_PLUGINS_MAX_HOST_BYTES or lower another holder's share``
    """
    left = max(0, limit() - usage()["total"])
    return (
        f"need {describe_bytes(nbytes)} but only {describe_bytes(left)} of {limit_text()} "
        f"remain (held: {held_text()}); raise {MAX_HOST_BYTES.name} or lower another holder's "
        "share"
    )


def reserve(owner: str, nbytes: int) -> bool:
    """Reserve ``nbytes`` for ``owner`` (a plugin name); False, reserving nothing, when the
    plugins' holdings would pass :func:`limit`."""
    if nbytes <= 0:
        return True
    with _LOCK:
        if sum(_HELD.values()) + nbytes > limit():
            return False
        _HELD[owner] = _HELD.get(owner, 0) + nbytes
        return True


def release(owner: str, nbytes: int) -> None:
    """Give back ``nbytes`` that ``owner`` reserved (never below zero)."""
    with _LOCK:
        _HELD[owner] = max(0, _HELD.get(owner, 0) - nbytes)


def usage() -> dict[str, int]:
    """Bytes held per plugin, plus ``total`` and ``limit`` (for reports and doctor)."""
    with _LOCK:
        held = {owner: n for owner, n in _HELD.items() if n}
    return {**held, "total": sum(held.values()), "limit": limit()}


class Reservation:
    """The bytes one owner (one pool, one snapshot store) holds in the ledger; whatever is
    still held is released when the owner closes it or is garbage-collected, so a discarded
    pool never leaves the ledger over-counted."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._held = [0]  # boxed: the finalizer must not keep ``self`` alive
        self._finalizer = weakref.finalize(self, _release_box, owner, self._held)

    @property
    def held(self) -> int:
        """Bytes this reservation holds."""
        return self._held[0]

    def grow(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` more; False (nothing reserved) when over the shared limit."""
        if not reserve(self.owner, nbytes):
            return False
        self._held[0] += nbytes
        return True

    def shrink(self, nbytes: int) -> None:
        """Give back ``nbytes`` of what this reservation holds."""
        nbytes = min(nbytes, self._held[0])
        self._held[0] -= nbytes
        release(self.owner, nbytes)

    def close(self) -> None:
        """Give back everything held."""
        self.shrink(self._held[0])


def _release_box(owner: str, box: list[int]) -> None:
    release(owner, box[0])
    box[0] = 0
