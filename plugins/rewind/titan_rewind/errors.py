"""The error rewind raises when rolling back cannot help."""

from __future__ import annotations


class RewindError(RuntimeError):
    """Training cannot recover by rewinding (repeated faults, or a fault with no snapshot)."""
