"""``find_elsewhere``: what the other ``sys.meta_path`` finders give for a module, shared by the
one-shot activation trigger (:mod:`titan_plugins.autoload`) and the post-import watchers
(:mod:`titan_plugins.patching.watcher`). A leaf (standard library only), so neither imports the
other.
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec
from typing import Any


def find_elsewhere(me: object, fullname: str, path: Any, target: Any) -> ModuleSpec | None:
    """The spec the other finders on ``sys.meta_path`` give for ``fullname`` (``me`` skipped)."""
    for finder in sys.meta_path:
        if finder is me:
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(fullname, path, target) if find is not None else None
        if spec is not None:
            return spec
    return None
