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


def effect() -> dict[str, Any]:
    """This rank's rewind numbers for an after-training table: ``active``, ``steps_checked``,
    ``rewinds`` and ``events`` (step, trigger, value, threshold, snapshot_step, steps_skipped,
    microbatches_skipped, level, seconds), ``snapshots`` held (step, stable, age),
    ``snapshots_taken``, ``host_bytes``, ``bytes_per_snapshot``, ``host_budget``."""
    from titan_rewind import runtime

    rewinder = runtime.current()
    if rewinder is None:
        return {"active": False}
    return {"active": True, **rewinder.effect()}
