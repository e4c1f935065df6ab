"""Is Mooncake Transfer Engine usable here? (the core's probe when present, else our own)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class MooncakeProbe:
    """Same fields as the core's ``titan_plugins.platform.Probe``."""

    available: bool
    detail: str
    fix: str


_FIX = (
    "apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 && "
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (or the CUDA wheel "
    "mooncake-transfer-engine on GPU hosts)"
)


def probe_mooncake() -> MooncakeProbe:
    """Whether ``mooncake.engine.TransferEngine`` imports, with the reason and fix when not."""
    try:
        platform = importlib.import_module("titan_plugins.platform")
        probe = platform.probe_mooncake()
        return MooncakeProbe(bool(probe.available), str(probe.detail), str(probe.fix))
    except (ImportError, AttributeError):
        pass  # older core without the probe: fall through to the direct check
    try:
        engine = importlib.import_module("mooncake.engine")
        engine.TransferEngine  # noqa: B018 - the attribute is what we need
    except Exception as exc:  # an ImportError, or OSError from a missing libibverbs
        return MooncakeProbe(False, f"mooncake.engine does not import: {exc}", _FIX)
    return MooncakeProbe(True, "mooncake.engine.TransferEngine importable", "")
