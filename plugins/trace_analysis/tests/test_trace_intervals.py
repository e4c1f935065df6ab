"""Interval arithmetic against a brute-force model on random inputs (the map step's hot loops
were rewritten for speed; the results must not move by a bit)."""

from __future__ import annotations

import random

import pytest
from titan_trace_analysis import intervals as iv

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


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
        ints = [(int(a), int(b) + 1) for a, b in sorted(pairs)]  # not floats: the Python loop
        assert iv.union_sorted(ints, gap) == _reference_union(ints, gap)
        assert iv.length(want) == sum(b - a for a, b in want)


@pytest.mark.parametrize("seed", range(10))
def test_union_of_unsorted_pairs_is_the_sorted_union_bit_for_bit(seed: int):
    """The C union sorts by start itself: the same runs opened by the same float objects as
    sorted() + the Python loop (repr compares -0.0 and 0.0 apart), ties and zero widths too."""
    rng = random.Random(seed)
    pairs = _random_pairs(rng, rng.randint(1, 400))
    pairs += [(0.0, 1.0), (-0.0, 2.0), (-0.0, 1.0), (5.0, 5.0), (5.0, 5.0)]
    rng.shuffle(pairs)
    for gap in (0.0, 0.5):
        want = iv.union_sorted(sorted(pairs), gap)
        assert repr(iv.union(pairs, gap)) == repr(want)
        assert repr(iv.union(iter(pairs), gap)) == repr(want)
    nan = [(1.0, float("nan")), (1.0, 2.0)]  # no order (and its runs differ): Python decides
    assert repr(iv.union(nan)) == repr(iv.union_sorted(sorted(nan)))


def test_the_c_union_is_used_where_built():
    from titan_trace_analysis import fastpath

    built = fastpath.native_scan() is not None
    assert (iv._any is not None) == built


def test_union_of_nothing_and_of_one():
    assert iv.union([]) == [] and iv.union_sorted(iter([])) == []
    assert iv.union([(2.0, 3.0)]) == [[2.0, 3.0]]
    assert iv.union([(1.0, 2.0), (2.0, 3.0), (3.5, 4.0)]) == [[1.0, 3.0], [3.5, 4.0]]
    assert iv.union([(1.0, 2.0), (2.4, 3.0)], gap=0.5) == [[1.0, 3.0]]


@pytest.mark.parametrize("seed", range(10))
def test_union_of_op_heads_is_the_union_of_their_pairs_bit_for_bit(seed: int):
    """``union_heads`` reads (start, end) from the first two fields of each op in C: the same
    runs as the union of the sliced pairs, ties, -0.0 and the Python fallback included."""
    from titan_trace_analysis.ops import Op

    rng = random.Random(seed)
    pairs = _random_pairs(rng, rng.randint(1, 300)) + [(0.0, 1.0), (-0.0, 2.0), (5.0, 5.0)]
    rng.shuffle(pairs)
    ops = [Op(a, b, rng.randint(0, 2), "", None, "", -1) for a, b in pairs]
    for gap in (0.0, 0.5):
        want = repr(iv.union_sorted(sorted(pairs), gap))
        assert repr(iv.union_heads(ops, gap)) == want
        assert repr(iv.union_heads([(a, b, "x") for a, b in pairs], gap)) == want  # plain tuples
    # what the C code declines (an int time, a NaN, a short item) goes through iv.union
    mixed = [*ops, Op(3, 4.0, 0, "", None, "", -1)]
    assert iv.union_heads(mixed) == iv.union([o[:2] for o in mixed])
    nan = [*ops, Op(1.0, float("nan"), 0, "", None, "", -1)]
    assert repr(iv.union_heads(nan)) == repr(iv.union([o[:2] for o in nan]))
    with pytest.raises(ValueError):  # a one-field item: the same error as unpacking its slice
        iv.union_heads([(1.0,)])
    if iv._any is not None:  # the C path takes ops (no Python fallback on this input)
        assert iv._any(ops, 0.0, True) is not None
        assert iv._any([(1.0,)], 0.0, True) is None


@pytest.mark.parametrize("seed", range(10))
def test_clipped_union_and_overlap_match_the_python_loops_bit_for_bit(seed: int, monkeypatch):
    """The C union clips as ``clip`` does (Python's max / min tie rules: -0.0 and 0.0 stay what
    they were; bounds on run edges, outside every run, NaN) and the C overlap adds the same
    lengths in the same order: compared with the Python code on the same inputs."""
    from titan_trace_analysis.ops import Op

    rng = random.Random(100 + seed)
    pairs = _random_pairs(rng, rng.randint(0, 300)) + [(-0.0, 1.0), (0.0, 0.0), (7.0, 9.0)]
    rng.shuffle(pairs)
    ops = [Op(a, b, 0, "", None, "", -1) for a, b in pairs]
    edges = [x for ab in pairs for x in ab]
    bounds = [(-1e18, 1e18), (0.0, 1.0), (-0.0, 0.0), (1.0, 0.5), (float("nan"), 5.0)]
    bounds += [tuple(sorted(rng.sample(edges, 2))) for _ in range(6)] if len(edges) > 1 else []
    for lo, hi in bounds:
        want = repr(iv.clip(iv.union_heads(ops), lo, hi))
        assert repr(iv.clipped_union_heads(ops, lo, hi)) == want, (lo, hi)
    assert iv.clipped_union_heads(ops, 0, 10) == iv.clip(iv.union_heads(ops), 0, 10)  # ints
    for a, b, lo, hi in [(0.0, 2.0, -0.0, 1.0), (-0.0, 2.0, 0.0, 1.0), (-1.0, 0.0, -2.0, -0.0),
                         (-1.0, -0.0, -2.0, 0.0)]:  # fmt: skip
        one = [Op(a, b, 0, "", None, "", -1)]  # a bound equal to a run's edge, other zero sign
        want = repr(iv.clip(iv.union_heads(one), lo, hi))
        assert repr(iv.clipped_union_heads(one, lo, hi)) == want, (a, b, lo, hi)
    other = iv.union(_random_pairs(rng, rng.randint(0, 200)))
    merged = iv.union(pairs)
    native = [iv.overlap(merged, other), iv.overlap(other, merged), iv.overlap(merged, [])]
    monkeypatch.setattr(iv, "_overlap", None)  # the Python loop
    python = [iv.overlap(merged, other), iv.overlap(other, merged), iv.overlap(merged, [])]
    assert repr(native) == repr(python)
    if iv._any is not None:  # the C paths took these inputs (no silent fallback)
        from titan_trace_analysis import _native

        assert _native.union_any(ops, 0.0, True, 0.0, 1.0) is not None
        assert _native.overlap(merged, other) is not None
        assert _native.overlap([[1, 2]], merged) is None  # ints: the Python loop decides


@pytest.mark.parametrize("seed", range(10))
def test_compute_gaps_in_c_match_the_python_loop_bit_for_bit(seed: int):
    """``bubble._gaps`` (C where built) against ``_gaps_py``: the same gaps, the same objects
    (repr tells -0.0 from 0.0), launches from the op, from the launch table or unknown."""
    import math

    from titan_trace_analysis import bubble
    from titan_trace_analysis.ops import Op, sort_ops

    rng = random.Random(200 + seed)
    launches = {c: (rng.uniform(0, 900), 7) for c in range(0, 40, 2)}
    ops = []
    for a, b in _random_pairs(rng, rng.randint(0, 200)) + [(-0.0, 0.0), (0.0, 3.0)]:
        corr = rng.choice([None, rng.randrange(40), rng.randrange(40)])
        posted = rng.choice([math.nan, math.nan, rng.uniform(0, 900), -0.0])
        ops.append(Op(a, b, 0, "", corr, "", -1, False, posted))
    ops = sort_ops(ops)
    for w0, w1 in [(-1e18, 1e18), (-0.0, 500.0), (0.0, 0.0), (100.0, 50.0)]:
        want = repr(bubble._gaps_py(ops, w0, w1, launches))
        assert repr(bubble._gaps(ops, w0, w1, launches)) == want, (w0, w1)
    edge = [Op(-1.0, -0.0, 0, "", None, "", -1), Op(5.0, 6.0, 0, "", 2, "", -1)]
    for w0, w1 in [(0.0, 10.0), (0.0, 5.0), (-0.0, 4.9)]:  # an end equal to the run's, other
        # zero sign; an op starting exactly at the window's end; one just after
        assert repr(bubble._gaps(edge, w0, w1, launches)) == repr(
            bubble._gaps_py(edge, w0, w1, launches)
        )
    if bubble._native_gaps is not None:  # the C loop took them; odd inputs go to Python
        assert bubble._native_gaps(ops, 0.0, 1e18, launches) is not None
        odd = [*ops, Op(1e17, 2e17, 0, "", "c", "", -1)]  # ends a gap; its corr is not an int
        assert bubble._native_gaps(odd, 0.0, 1e18, launches) is None
        assert bubble._native_gaps(ops, 0, 1e18, launches) is None  # an int bound


def test_ops_tied_up_to_a_missing_correlation_id_sort_instead_of_raising():
    """Two kernels at the same times, one with a launch correlation id and one without: the
    step's figures are computed (before, sorting the ops raised TypeError and the whole rank
    was reported unreadable); otherwise the order is sorted()'s."""
    from titan_trace_analysis.kinds import COMM, COMPUTE, PP_RECV
    from titan_trace_analysis.ops import Op, sort_ops
    from titan_trace_analysis.steps import one_step

    a, b = Op(1.0, 2.0, COMPUTE, "", 5, "", -1), Op(1.0, 2.0, COMPUTE, "", None, "", -1)
    assert sort_ops([a, b]) == [b, a]
    usual = [Op(3.0, 4.0, COMPUTE, "", 9, "", -1), a, Op(1.0, 2.0, COMPUTE, "", 2, "", -1)]
    assert sort_ops(usual) == sorted(usual)
    recv = Op(2.5, 3.5, COMM, PP_RECV, None, "k", 1)
    stat, timeline = one_step(0.0, 10.0, [a, b, recv, Op(3.6, 6.0, COMPUTE, "", 7, "", -1)], {})
    assert stat["compute_busy_us"] == 1.0 + 2.4 and stat["bubble_us"] is not None
    recv2 = Op(2.5, 3.5, COMM, PP_RECV, 4, "k", 1)  # and the same among communication ops
    stat2, _ = one_step(0.0, 10.0, [a, recv, recv2], {})
    assert stat2["comm_busy_us"] == 1.0
