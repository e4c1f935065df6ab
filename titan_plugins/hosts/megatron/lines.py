"""The megatron-core release lines the Megatron host serves, and their version gates.

Standard library only, importing nothing of the core but the gate builder
(:mod:`titan_plugins.hosts.spans`); the generic gate machinery
(:mod:`titan_plugins.patching.gates`) reads these through :data:`titan_plugins.hosts.HOSTS`.
"""

from __future__ import annotations

from titan_plugins.hosts.spans import every_span_gate, span_gate

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
    return span_gate(DISTRIBUTION, MEGATRON_LINES, first, last, "megatron lines")


SUPPORTED_MEGATRON = megatron_lines()
"""Every Megatron line the plugins serve: the ``requires=`` of a patch whose target and contract
are the same on all of them (checked per release in ``tests/test_megatron_lines.py``)."""

LINE_GATES = every_span_gate(DISTRIBUTION, MEGATRON_LINES, "megatron lines")
"""Every :func:`megatron_lines` gate: a patch failing only these was written for another line."""
