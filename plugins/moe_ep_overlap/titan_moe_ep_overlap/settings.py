"""The plugin's knobs (``TITAN_MOE_EP_OVERLAP_*``): declared once here, read only via ``.read()``
(at use time, so a value set after import counts; a bad value warns once, or raises under STRICT,
and the default applies)."""

from __future__ import annotations

from titan_plugins.settings import Setting

BACKEND = Setting(
    "TITAN_MOE_EP_OVERLAP_BACKEND",
    str,
    "auto",
    "dispatch/combine backend: auto = DeepEP v1 when installed and API-compatible, else "
    "torch.distributed; torch or deep_ep to force one",
    choices=("auto", "torch", "deep_ep"),
)
CHUNKS = Setting(
    "TITAN_MOE_EP_OVERLAP_CHUNKS",
    int,
    4,  # 4 chunks hide ~3/4 of the all-to-all time when comm ~ compute
    "token chunks per MoE layer whose dispatch/compute/combine are pipelined "
    "(1 = megatron's unchunked flex path through the backend); same value on every EP rank",
    minimum=1,
)
AUTO = Setting(
    "TITAN_MOE_EP_OVERLAP_AUTO",
    bool,
    True,
    "time the serial and the pipelined forward of each MoE layer and pipeline only where it is "
    "faster (all EP ranks agree); 0 = always pipeline with CHUNKS",
)

SETTINGS = [BACKEND, CHUNKS, AUTO]
