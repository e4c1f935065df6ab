"""Titan plugin ``rewind``: in-memory rollback to the last stable state on NaN/Inf, loss spikes
and grad-norm spikes, without a restart. Importing this package has no side effect.

:func:`effect` is the public accessor of this rank's numbers (rewinds, snapshots, bytes);
:class:`RewindError` is raised when rolling back cannot help.
"""

from __future__ import annotations

from typing import Any

from titan_rewind.errors import RewindError
from titan_rewind.version import __version__

__all__ = ["RewindError", "__version__", "effect"]


def __getattr__(name: str) -> Any:
    # ``effect`` is looked up on first use (PEP 562): the package imports nothing of the state
    # machine, whose modules import the package back (``from titan_rewind import settings``).
    if name == "effect":
        from titan_rewind.runtime import effect

        return effect
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
