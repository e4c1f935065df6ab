"""The name rules checked without regular expressions (they run inside ``import megatron``)
accept exactly what their patterns accept."""

from __future__ import annotations

import itertools
import re

import pytest

from titan_plugins import settings, switches

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

# every string up to length 4 over an alphabet with each character class the rules tell apart
ALPHABET = "aZ0_-.é "
CASES = ["".join(p) for n in range(5) for p in itertools.product(ALPHABET, repeat=n)]
CASES += ["fp8_blockwise", "TITAN_PP_RDMA_HOST", "a__b", "_a", "a_", "A1_", "a1_b2", "x" * 64]


def test_upper_snake_is_the_pattern() -> None:
    pattern = re.compile(r"[A-Z][A-Z0-9_]*")
    for case in CASES + [c.upper() for c in CASES]:
        assert settings._is_upper_snake(case) is bool(pattern.fullmatch(case)), case


def test_lower_snake_is_the_pattern() -> None:
    pattern = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
    for case in CASES + [c.lower() for c in CASES]:
        assert switches._is_lower_snake(case) is bool(pattern.fullmatch(case)), case
