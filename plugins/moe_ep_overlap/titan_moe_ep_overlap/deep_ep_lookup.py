"""Whether a ``deep_ep`` package is importable, found without importing it: a leaf.

Its own module because both the patch records (:mod:`titan_moe_ep_overlap.patches`, asked while
megatron imports) and the backend choice (:mod:`titan_moe_ep_overlap.selection`, which must not
load then) ask it; in either of them the other would import it back in a circle.
"""

from __future__ import annotations

import importlib.util
import sys


def deep_ep_installed() -> bool:
    """Whether a ``deep_ep`` package is importable (found, not imported)."""
    if "deep_ep" in sys.modules:
        return True
    # Asked once per fused_a2a name while megatron imports (a search of sys.path each, ~0.3
    # ms): the answer is kept for the same sys.path.
    key = tuple(sys.path)
    found = _FOUND_ON_PATH.get(key)
    if found is None:
        try:
            found = importlib.util.find_spec("deep_ep") is not None
        except (ValueError, ImportError):
            found = False
        _FOUND_ON_PATH[key] = found
    return found


_FOUND_ON_PATH: dict[tuple[str, ...], bool] = {}
