"""The SGLang releases the SGLang host serves, and their version gates.

Standard library only and importing nothing of the core (the gate machinery reads these through
:data:`titan_plugins.hosts.HOSTS`). SGLang is installed as a distribution (a wheel, or an
editable install of its ``python/`` folder), so gates are judged on its metadata.
"""

from __future__ import annotations

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
    if first not in SGLANG_RELEASES or last not in SGLANG_RELEASES:
        raise ValueError(f"sglang releases {first!r}..{last!r}: known ones are {SGLANG_RELEASES}")
    if SGLANG_RELEASES.index(first) > SGLANG_RELEASES.index(last):
        raise ValueError(f"sglang releases {first!r}..{last!r}: first is newer than last")
    major, minor, patch = last.split(".")
    return f"sglang>={first},<{major}.{minor}.{int(patch) + 1}"


SUPPORTED_SGLANG = sglang_releases()
"""Every SGLang release the plugins serve (a patch whose target is the same on all of them)."""

LINE_GATES = frozenset(
    sglang_releases(first, last)
    for i, first in enumerate(SGLANG_RELEASES)
    for last in SGLANG_RELEASES[i:]
)
"""Every :func:`sglang_releases` gate: a patch failing only these was written for another
release."""
