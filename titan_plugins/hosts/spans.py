"""Version gates over a span of a host's releases (standard library only, importing nothing of
the core: each room's release module builds its gates with it)."""

from __future__ import annotations


def span_gate(
    distribution: str, releases: tuple[str, ...], first: str, last: str, what: str
) -> str:
    """The gate ``distribution>=first,<next`` of ``releases`` ``first`` through ``last``, both
    included, ``next`` being ``last`` with its final number raised by one (``0.19`` -> ``0.20``,
    ``0.5.23`` -> ``0.5.24``: every patch and post release of ``last`` is in).

    :param what: how messages name the releases (``"megatron lines"``).
    :raises ValueError: ``first`` or ``last`` is not one of ``releases``, or comes after the other.
    """
    if first not in releases or last not in releases:
        known = what.rsplit(" ", 1)[-1]
        raise ValueError(f"{what} {first!r}..{last!r}: known {known} are {releases}")
    if releases.index(first) > releases.index(last):
        raise ValueError(f"{what} {first!r}..{last!r}: first is newer than last")
    *head, final = last.split(".")
    return f"{distribution}>={first},<{'.'.join([*head, str(int(final) + 1)])}"


def every_span_gate(distribution: str, releases: tuple[str, ...], what: str) -> frozenset[str]:
    """:func:`span_gate` of every span of ``releases`` (a patch failing only these was written for
    another release of the host)."""
    return frozenset(
        span_gate(distribution, releases, first, last, what)
        for i, first in enumerate(releases)
        for last in releases[i:]
    )
