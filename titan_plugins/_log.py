"""The core's logger: quiet by default, every patch with TITAN_PLUGINS_DEBUG=1."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("titan_plugins")

DEBUG_HINT = "set TITAN_PLUGINS_DEBUG=1 for details"


def debug_enabled() -> bool:
    """Whether TITAN_PLUGINS_DEBUG is on (read at call time: switches are never cached)."""
    return os.environ.get("TITAN_PLUGINS_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


class _FallbackHandler(logging.StreamHandler):
    """Prints our records only when the root logger has no handler to print them.

    Megatron's workers often never configure logging; then this handler makes warnings
    visible with our prefix. When the host (or pytest) configured logging, records propagate
    to its handlers instead and are not printed twice.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def configure() -> None:
    """Attach the fallback handler once; DEBUG level when TITAN_PLUGINS_DEBUG is on."""
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        handler = _FallbackHandler()
        handler.setFormatter(logging.Formatter("[titan_plugins] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    if debug_enabled():
        logger.setLevel(logging.DEBUG)
