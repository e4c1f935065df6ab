"""The core's report is strict JSON whatever a plugin's report holds (tuple keys, NaN, objects)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_plugins.jsonable import jsonable

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


@dataclass
class _Event:
    step: int
    loss: float


def test_tuple_keys_non_finite_floats_and_objects_become_strict_json() -> None:
    value = {
        "unit_bytes": {(0, 1): 10, (1, 0): 20},
        "loss": math.nan,
        "limits": (math.inf, -math.inf, 1.5),
        "seen": {3, 1, 2},
        "path": Path("/tmp/x"),
        "event": _Event(3, math.nan),
        4: True,
    }
    out = jsonable(value)
    text = json.dumps(out, allow_nan=False)  # raises on NaN / Inf or a non-str key
    assert json.loads(text) == {
        "unit_bytes": {"0,1": 10, "1,0": 20},
        "loss": "nan",
        "limits": ["inf", "-inf", 1.5],
        "seen": [1, 2, 3],
        "path": "/tmp/x",
        "event": {"step": 3, "loss": "nan"},
        "4": True,
    }


def test_a_cycle_is_cut_not_recursed() -> None:
    looped: dict = {}
    looped["self"] = looped
    text = json.dumps(jsonable(looped))
    assert "cut at depth" in text


def test_the_report_converts_each_plugins_own_answers() -> None:
    from titan_plugins import report

    class Plugin:
        @staticmethod
        def titan_effects() -> dict:
            return {"by_unit": {(0, 0): 1}, "ratio": math.inf}

    assert report._own_dict(Plugin, "titan_effects") == {"by_unit": {"0,0": 1}, "ratio": "inf"}
