"""Interval arithmetic against a brute-force model on random inputs (the map step's hot loops
were rewritten for speed; the results must not move by a bit)."""

from __future__ import annotations

import random

import pytest
from titan_trace_analysis import intervals as iv


def _reference_union(pairs: list[tuple[float, float]], gap: float) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(pairs):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _random_pairs(rng: random.Random, n: int) -> list[tuple[float, float]]:
    pairs = []
    for _ in range(n):
        a = rng.choice([rng.uniform(-50, 1000), float(rng.randint(0, 40)), 1e15 + rng.random()])
        pairs.append((a, a + rng.choice([0.0, rng.expovariate(0.1), 0.1 + 0.2])))
    return pairs


@pytest.mark.parametrize("seed", range(20))
def test_union_matches_the_model(seed: int):
    rng = random.Random(seed)
    pairs = _random_pairs(rng, rng.randint(0, 300))
    for gap in (0.0, 0.5, 3.0):
        want = _reference_union(pairs, gap)
        assert iv.union(pairs, gap) == want
        assert iv.union_sorted(iter(sorted(pairs)), gap) == want  # generators too
        assert iv.union_sorted_py(iter(sorted(pairs)), gap) == want  # the loop without C
        ints = [(int(a), int(b) + 1) for a, b in sorted(pairs)]  # not floats: the Python loop
        assert iv.union_sorted(ints, gap) == _reference_union(ints, gap)
        assert iv.length(want) == sum(b - a for a, b in want)


def test_the_c_union_is_used_where_built():
    from titan_trace_analysis import fastpath

    assert (iv._native is not None) == (fastpath.native_scan() is not None)


def test_union_of_nothing_and_of_one():
    assert iv.union([]) == [] and iv.union_sorted(iter([])) == []
    assert iv.union([(2.0, 3.0)]) == [[2.0, 3.0]]
    assert iv.union([(1.0, 2.0), (2.0, 3.0), (3.5, 4.0)]) == [[1.0, 3.0], [3.5, 4.0]]
    assert iv.union([(1.0, 2.0), (2.4, 3.0)], gap=0.5) == [[1.0, 3.0]]
