"""The SGLang releases the SGLang host serves, and their version gates.

Standard library only, importing nothing of the core but the gate builder
:mod:`titan_plugins.hosts.spans` (the gate machinery reads these through
:data:`titan_plugins.hosts.HOSTS`). SGLang is installed as a distribution (a wheel, or an
editable install of its ``python/`` folder), so gates are judged on its metadata.
"""

from __future__ import annotations

from titan_plugins.hosts.spans import every_span_gate, span_gate

PACKAGE = "sglang"
"""The import package (SGLang keeps no ``package_info``: the distribution's metadata is read)."""
DISTRIBUTION = "sglang"
"""The distribution the gates name."""
TRIGGER_PREFIXES: tuple[str, ...] = ()
"""None: SGLang processes reach the registry through SGLang's own plugin loader (the
``sglang.srt.plugins`` entry point, ``titan_entrypoints.sglang_plugins``), which honours
``SGLANG_PLUGINS``; an ``import sglang`` in a trainer (slime and miles import it) activates
nothing by itself."""

SGLANG_RELEASES = ("0.5.15", "0.5.23")
"""The SGLang releases the plugins serve, oldest first: 0.5.15.post1 is slime's pin, 0.5.23 the
current release (the first with the ``begin_weight_update`` / ``end_weight_update`` session)."""


def sglang_releases(first: str = SGLANG_RELEASES[0], last: str = SGLANG_RELEASES[-1]) -> str:
    """The version gate of the SGLang releases ``first`` through ``last`` (their post releases
    included): ``sglang_releases("0.5.23")`` is ``"sglang>=0.5.23,<0.5.24"``."""
    return span_gate(DISTRIBUTION, SGLANG_RELEASES, first, last, "sglang releases")


SUPPORTED_SGLANG = sglang_releases()
"""Every SGLang release the plugins serve (a patch whose target is the same on all of them)."""

LINE_GATES = every_span_gate(DISTRIBUTION, SGLANG_RELEASES, "sglang releases")
"""Every :func:`sglang_releases` gate: a patch failing only these was written for another
release."""
