"""The core's logger: quiet by default, every patch with TITAN_PLUGINS_DEBUG=1."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("titan_plugins")

DEBUG_HINT = "set TITAN_PLUGINS_DEBUG=1 for details"


def debug_enabled() -> bool:
    """Whether TITAN_PLUGINS_DEBUG is on (read at call time: switches are never cached)."""
    return os.environ.get("TITAN_PLUGINS_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def configure() -> None:
    """Attach a stderr handler once, at DEBUG level when TITAN_PLUGINS_DEBUG is on.

    Warnings reach the user even when the host never configured logging (Megatron's
    workers often do not), so the handler is ours rather than the root logger's.
    """
    if not any(getattr(h, "_titan", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[titan_plugins] %(levelname)s %(message)s"))
        handler._titan = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if debug_enabled() else logging.WARNING)
