"""Distribution-free intervals for a median, shared by the benchmarks' verdicts.

Timings on a shared machine are not normal (long slow tails, drift between runs), so an
interval from order statistics, which assumes nothing but independent samples, is what a
verdict may rest on.
"""

from __future__ import annotations

import math


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval for the median: the order statistics k and n+1-k with the
    largest k whose binomial coverage is at least ``confidence`` (the whole range when even
    that covers less, below 6 values); returns (low, high, its coverage)."""
    ordered = sorted(values)
    n = len(ordered)
    k = 1
    while k < n // 2:
        # coverage of the next narrower pair (k+1, n-k): 1 - 2 P(Binomial(n, 1/2) <= k)
        tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
        if 1 - 2 * tail < confidence:
            break
        k += 1
    coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
    return ordered[k - 1], ordered[n - k], coverage
