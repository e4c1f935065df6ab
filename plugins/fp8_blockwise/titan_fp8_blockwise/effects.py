"""What the plugin did in this process: FP8 layer calls, FP8 GEMMs run, weight quantizations,
and the patch records it registered in this activation.

Counted where the work happens (the linear layer's forward and backward, the weight cache), so
the numbers say what ran, not what was configured. Light (no torch): reports read it at any time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

CALLS: Counter[str] = Counter()  # FP8 layer forwards by kind (ColumnParallelLinear[.expert], ...)
GEMMS: Counter[str] = Counter()  # FP8 GEMMs run, by pass: fprop, dgrad, wgrad
WEIGHT_CACHE = {"epoch": 0, "hits": 0, "misses": 0}  # see weight_cache
# id -> the records of the current activation (``titan_plugins.patching.Patch``); the engine
# updates each one's status in place and :mod:`titan_fp8_blockwise.features` judges each feature
# from them. Here, in a leaf that the patch records load anyway, so that the records and the
# feature judge (reached from the layers the records route to) share it without a circle.
REGISTERED: dict[str, Any] = {}


def track(records: list[Any]) -> None:
    """Remember the records the plugin registered in this activation."""
    REGISTERED.clear()
    REGISTERED.update({record.id: record for record in records})


def count_call(kind: str) -> None:
    """One FP8 layer forward of ``kind``."""
    CALLS[kind] += 1


def count_gemm(kind: str) -> None:
    """One FP8 GEMM of pass ``kind`` (``fprop``, ``dgrad`` or ``wgrad``) ran."""
    GEMMS[kind] += 1


def effects() -> dict[str, int]:
    """This process's counters, as numbers (empty when nothing ran in FP8 here).

    ``fp8_gemms``: FP8 GEMMs run, all passes; ``fp8_fprop_gemms`` / ``fp8_dgrad_gemms`` /
    ``fp8_wgrad_gemms``: per pass; ``fp8_layer_calls``: FP8 layer forwards (the kinds are in
    :data:`CALLS`); ``weight_quantizations``: 128x128-block quantizations of weights (weight
    cache misses: once per weight and step); ``weight_cache_hits``.
    """
    if not CALLS and not GEMMS:
        return {}
    return {
        "fp8_gemms": sum(GEMMS.values()),
        "fp8_fprop_gemms": GEMMS["fprop"],
        "fp8_dgrad_gemms": GEMMS["dgrad"],
        "fp8_wgrad_gemms": GEMMS["wgrad"],
        "fp8_layer_calls": sum(CALLS.values()),
        "weight_quantizations": WEIGHT_CACHE["misses"],
        "weight_cache_hits": WEIGHT_CACHE["hits"],
    }


def reset() -> None:
    """Zero the counters (tests and benchmarks measuring one run)."""
    CALLS.clear()
    GEMMS.clear()
    WEIGHT_CACHE.update(hits=0, misses=0)
