"""What the plugin did in this process: FP8 layer calls, FP8 GEMMs run, weight quantizations.

Counted where the work happens (the linear layer's forward and backward, the weight cache), so
the numbers say what ran, not what was configured. Light (no torch): reports read it at any time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

CALLS: Counter[str] = Counter()  # FP8 layer forwards by kind (ColumnParallelLinear[.expert], ...)
GEMMS: Counter[str] = Counter()  # FP8 GEMMs run, by pass: fprop, dgrad, wgrad
WEIGHT_CACHE = {"epoch": 0, "hits": 0, "misses": 0}  # see weight_cache


def count_call(kind: str) -> None:
    """One FP8 layer forward of ``kind``."""
    CALLS[kind] += 1


def count_gemm(kind: str) -> None:
    """One FP8 GEMM of pass ``kind`` (``fprop``, ``dgrad`` or ``wgrad``) ran."""
    GEMMS[kind] += 1


def effects() -> dict[str, Any]:
    """This process's counters.

    ``fp8_gemms``: FP8 GEMMs run (all passes); ``fp8_gemms_by_pass``; ``fp8_layer_calls`` by
    layer kind; ``weight_quantizations``: 128x128-block quantizations of weights (cache misses);
    ``weight_cache_hits``.
    """
    return {
        "fp8_gemms": sum(GEMMS.values()),
        "fp8_gemms_by_pass": dict(GEMMS),
        "fp8_layer_calls": dict(CALLS),
        "weight_quantizations": WEIGHT_CACHE["misses"],
        "weight_cache_hits": WEIGHT_CACHE["hits"],
    }


def reset() -> None:
    """Zero the counters (tests and benchmarks measuring one run)."""
    CALLS.clear()
    GEMMS.clear()
    WEIGHT_CACHE.update(hits=0, misses=0)
