"""The plugin's environment knobs (``TITAN_MOE_EP_OVERLAP_*``), read lazily at use time."""

from __future__ import annotations

import os

from titan_plugins.settings import Setting, env_bool, env_choice, env_int

BACKENDS = ("auto", "torch", "deep_ep")
DEFAULT_CHUNKS = 4  # 4 chunks hide ~3/4 of the all-to-all time when comm ~ compute


def backend_choice() -> str:
    """``TITAN_MOE_EP_OVERLAP_BACKEND``: auto (DeepEP v1 if compatible), torch or deep_ep."""
    return env_choice("TITAN_MOE_EP_OVERLAP_BACKEND", BACKENDS, "auto")


_parsed_chunks: dict[str | None, int] = {}  # raw value -> parsed: warn once, not per layer call


def num_chunks() -> int:
    """``TITAN_MOE_EP_OVERLAP_CHUNKS``: token chunks pipelined in a MoE layer (1 = no pipeline)."""
    raw = os.environ.get("TITAN_MOE_EP_OVERLAP_CHUNKS")
    if raw not in _parsed_chunks:
        _parsed_chunks[raw] = env_int("TITAN_MOE_EP_OVERLAP_CHUNKS", DEFAULT_CHUNKS, minimum=1)
    return _parsed_chunks[raw]


def auto() -> bool:
    """``TITAN_MOE_EP_OVERLAP_AUTO``: pipeline a layer only where it measured faster."""
    return env_bool("TITAN_MOE_EP_OVERLAP_AUTO", True)


def declared() -> list[Setting]:
    """The knobs, for ``titan-plugins env`` and the README."""
    return [
        Setting(
            var="TITAN_MOE_EP_OVERLAP_BACKEND",
            default="auto",
            doc="dispatch/combine backend: auto = DeepEP v1 when installed and API-compatible, "
            "else torch.distributed; torch or deep_ep to force one",
            choices=BACKENDS,
        ),
        Setting(
            var="TITAN_MOE_EP_OVERLAP_CHUNKS",
            default=str(DEFAULT_CHUNKS),
            doc="token chunks per MoE layer whose dispatch/compute/combine are pipelined "
            "(1 = megatron's unchunked flex path through the backend)",
        ),
        Setting(
            var="TITAN_MOE_EP_OVERLAP_AUTO",
            default="1",
            doc="time the serial and the pipelined forward of each MoE layer and pipeline only "
            "where it is faster (all EP ranks agree); 0 = always pipeline with CHUNKS",
        ),
    ]
