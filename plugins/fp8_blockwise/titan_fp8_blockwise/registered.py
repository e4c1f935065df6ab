"""The patch records of the current activation: a leaf.

The engine updates each record's status in place; :mod:`titan_fp8_blockwise.features` judges
each feature from them. Its own module (standard library only) so that the patch records
(:mod:`titan_fp8_blockwise.patches`, loaded at activation) and the feature judge (loaded only
when asked, from the layers that :mod:`titan_fp8_blockwise.patches` routes to) share it without
importing each other in a circle.
"""

from __future__ import annotations

from typing import Any

REGISTERED: dict[str, Any] = {}
"""id -> the records of the current activation (``titan_plugins.patching.Patch``)."""


def track(records: list[Any]) -> None:
    """Remember the records the plugin registered in this activation."""
    REGISTERED.clear()
    REGISTERED.update({record.id: record for record in records})
