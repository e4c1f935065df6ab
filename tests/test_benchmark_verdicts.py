"""The benchmarks' statistical verdicts: the median's interval and the pooled ping-pong goal."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
intervals = importlib.import_module("intervals")


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/pp_rdma.py with a quiet machine (its import sets MC_LOG_LEVEL: undone after)."""
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    loadguard = importlib.reload(importlib.import_module("loadguard"))
    monkeypatch.setattr(loadguard, "load", lambda: (0.1, 0.0, 0.0))
    module = importlib.import_module("pp_rdma")
    monkeypatch.setattr(module, "loadguard", loadguard)
    return module


ARGS = argparse.Namespace(force=False, max_load=1.5)


def test_the_interval_narrows_only_while_it_keeps_its_coverage():
    # 5 values: the whole range covers the median 1 - 2/32 of the time, no narrower pair 95%
    assert intervals.median_interval([5, 1, 4, 2, 3]) == (1, 5, 1 - 2 / 32)
    # 11 values: the 2nd and 10th cover 1 - 2 * 12/2048; the 3rd and 9th (93.5%) do not reach 95%
    low, high, coverage = intervals.median_interval(list(range(11)))
    assert (low, high) == (1, 9)
    assert coverage == pytest.approx(1 - 2 * 12 / 2048)
    # at 90% the 3rd and 9th do
    assert intervals.median_interval(list(range(11)), 0.9)[:2] == (2, 8)


def test_a_median_ratio_of_one_meets_the_goal_whatever_the_cap(bench):
    runs = [(1.0, 1.2), (0.9, 1.3), (1.1, 0.8), (1.05, 1.1), (0.95, 0.7)]
    assert bench.pooled_verdict(runs, ARGS) == "met"


def test_a_cap_is_shown_only_when_its_whole_interval_is_below_one(bench):
    below = [(0.6, 0.7), (0.7, 0.8), (0.65, 0.95), (0.5, 0.6), (0.7, 0.9)]
    verdict = bench.pooled_verdict(below, ARGS)
    assert verdict.startswith("NOT met: capped")
    assert "0.60-0.95 below 1.0" in verdict
    # the same median cap (0.80), one run's cap at 1.05: the interval reaches 1.0
    reaching = [*below[:4], (0.7, 1.05)]
    verdict = bench.pooled_verdict(reaching, ARGS)
    assert verdict.startswith("NOT met, and no cap shown")
    assert "0.60-1.05 reaches 1.0" in verdict


def test_too_few_runs_show_no_cap(bench):
    verdict = bench.pooled_verdict([(0.5, 0.6), (0.6, 0.7), (0.55, 0.65)], ARGS)
    assert verdict.startswith("NOT met; 3 runs cannot show a cap")
    assert "--runs 5" in verdict


def test_a_busy_machine_withholds_the_pooled_verdict(bench, monkeypatch):
    monkeypatch.setattr(bench.loadguard, "load", lambda: (3.0, 0.0, 0.0))
    assert bench.pooled_verdict([(1.2, 1.0)] * 5, ARGS).startswith("no verdict")


def test_one_run_never_calls_its_cap_a_cap(bench):
    # below 1.0 or not, one run's cap is reported as that run's, and the pooled runs judge it
    for cap in (0.5, 1.2):
        text = bench._unmet(cap, "; pp_rdma reaches 80% of it")
        assert text.startswith(f"NOT met (this run's cap {cap:.2f}x; pp_rdma reaches 80% of it")
        assert "caps any protocol" not in text and "--runs 5" in text
