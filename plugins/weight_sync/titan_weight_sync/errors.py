"""The plugin's one error type."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync could not be done; the message names the cause and what runs instead."""
