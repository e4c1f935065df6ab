"""Titan plugins: a registry that applies independently installed optimisation plugins to the
official, unmodified Megatron-LM at import time.

Plugins implement the hooks in :mod:`titan_plugins.hookspecs` with :data:`hookimpl` and are
found through the ``titan_plugins`` entry-point group. Importing this package has no side
effect; activation happens through the torch.backends entry point, :func:`apply`, or
``titan-run``.

The public names load on first use: the torch.backends entry point imports this package inside
every ``import torch`` and needs none of them (see :mod:`titan_plugins.autoload`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_plugins.version import __version__

if TYPE_CHECKING:
    from titan_plugins.activation import active_manager, apply, undo
    from titan_plugins.hookspecs import hookimpl

__all__ = ["__version__", "active_manager", "apply", "hookimpl", "undo"]

_LAZY = {
    "active_manager": "titan_plugins.activation",
    "apply": "titan_plugins.activation",
    "undo": "titan_plugins.activation",
    "hookimpl": "titan_plugins.hookspecs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'titan_plugins' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
