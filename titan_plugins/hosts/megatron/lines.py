"""The megatron-core release lines the Megatron host serves, and their version gates.

Standard library only and importing nothing of the core: the generic gate machinery
(:mod:`titan_plugins.patching.gates`) reads these through :data:`titan_plugins.hosts.HOSTS`.
"""

from __future__ import annotations

PACKAGE = "megatron.core"
"""The import package whose ``package_info`` holds the version of the code."""
DISTRIBUTION = "megatron-core"
"""The distribution that normally ships :data:`PACKAGE` (the name the gates use)."""
TRIGGER_PREFIXES = ("megatron",)
"""Top-level packages whose first executed module starts activation."""

MEGATRON_LINES = ("0.16", "0.17", "0.18", "0.19")
"""The megatron-core release lines the plugins serve, oldest first (0.16 includes the 0.16.0rc0
commits slime and miles run, provisionally: see :mod:`titan_plugins.patching.gates`)."""


def megatron_lines(first: str = MEGATRON_LINES[0], last: str = MEGATRON_LINES[-1]) -> str:
    """The version gate of the megatron-core lines ``first`` through ``last``, both included:
    ``megatron_lines("0.18")`` is ``"megatron-core>=0.18,<0.20"``, ``megatron_lines("0.16",
    "0.17")`` is ``"megatron-core>=0.16,<0.18"``. A patch whose target moved or changed upstream
    declares one record per variant, each gated on the lines whose code it was written for."""
    if first not in MEGATRON_LINES or last not in MEGATRON_LINES:
        raise ValueError(f"megatron lines {first!r}..{last!r}: known lines are {MEGATRON_LINES}")
    if MEGATRON_LINES.index(first) > MEGATRON_LINES.index(last):
        raise ValueError(f"megatron lines {first!r}..{last!r}: first is newer than last")
    major, minor = last.split(".")
    return f"megatron-core>={first},<{major}.{int(minor) + 1}"


SUPPORTED_MEGATRON = megatron_lines()
"""Every Megatron line the plugins serve: the ``requires=`` of a patch whose target and contract
are the same on all of them (checked per release in ``tests/test_megatron_lines.py``)."""

LINE_GATES = frozenset(
    megatron_lines(first, last)
    for i, first in enumerate(MEGATRON_LINES)
    for last in MEGATRON_LINES[i:]
)
"""Every :func:`megatron_lines` gate: a patch failing only these was written for another line."""
