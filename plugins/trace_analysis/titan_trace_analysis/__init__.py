"""titan-trace-analysis: capture per-rank Kineto traces in unmodified Megatron, analyse them.

Importing the package is cheap (the plugin's registration must not slow ``import megatron``);
:func:`summarize_dir` loads the analyzer on first use.
"""

from __future__ import annotations

from typing import Any

from .version import __version__ as __version__

__all__ = ["__version__", "html_path", "summarize_dir"]


def __getattr__(name: str) -> Any:
    if name in ("summarize_dir", "html_path"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
