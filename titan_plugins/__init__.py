"""Titan plugins: a registry that applies independently installed optimisation plugins to the
official, unmodified Megatron-LM at import time.

Plugins implement the hooks in :mod:`titan_plugins.hookspecs` with :data:`hookimpl` and are
found through the ``titan_plugins`` entry-point group. Importing this package has no side
effect; activation happens through the torch.backends entry point, :func:`apply`, or
``titan-run``.
"""

from __future__ import annotations

from titan_plugins.activation import active_manager, apply, undo
from titan_plugins.hookspecs import hookimpl
from titan_plugins.version import __version__

__all__ = ["__version__", "active_manager", "apply", "hookimpl", "undo"]
