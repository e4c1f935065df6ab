"""Fuzz: a seeded mutator over real traces (HTA's 2-rank set and a generated pair) produces
damaged files of every kind; the analyzer, run in a subprocess under a memory cap
(RLIMIT_AS) and a CPU-time cap, must finish, write valid JSON, account for every input file
(analysed or reported), and print nothing unsafe to the terminal."""

from __future__ import annotations

import gzip
import json
import random
import re
import resource
import subprocess
import sys
from pathlib import Path

import gen_traces
import pytest

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

DATA = Path(__file__).resolve().parent / "data" / "hta"
MEMORY_CAP = 1536 << 20  # bytes of address space for the analyzer process
CPU_CAP_S = 120
MUTANTS = 36
SEED = 20261201


def _mutate(text: str, rng: random.Random) -> str:
    """One random damage to a trace's JSON text."""
    how = rng.randrange(9)
    n = len(text)
    if how == 0:  # cut anywhere
        return text[: rng.randrange(n)]
    if how == 1:  # flip bytes
        chars = list(text)
        for _ in range(rng.randrange(1, 50)):
            chars[rng.randrange(n)] = chr(rng.randrange(0, 256))
        return "".join(chars)
    if how == 2:  # delete or duplicate a span
        a = rng.randrange(n)
        b = min(n, a + rng.randrange(1, 5000))
        return text[:a] + (text[a:b] * 2 if rng.random() < 0.5 else "") + text[b:]
    if how == 3:  # absurd numbers
        repl = rng.choice(["1e308", "-1e308", "NaN", "Infinity", "-5", "99999999999999999999"])
        return re.sub(r'"(ts|dur)": [0-9.]+', lambda m: f'"{m[1]}": {repl}', text, count=40)
    if how == 4:  # hostile header fields
        value = rng.choice(['"x"', "[3]", str(10**11), "-1", "true", '"../../x"', "{}", "1.5"])
        key = rng.choice(["rank", "world_size"])
        return re.sub(rf'"{key}": [0-9]+', f'"{key}": {value}', text, count=1)
    if how == 5:  # deep nesting
        a = rng.randrange(n)
        return text[:a] + "[" * 3000 + "]" * 3000 + text[a:]
    if how == 6:  # control characters and quotes in names
        return text.replace('"name": "', '"name": "\\u001b[2J\\"x', rng.randrange(1, 30))
    if how == 7:  # args of the wrong type
        return text.replace('"args": {', '"args": [{', 5).replace("}}, {", "}]}, {", 5)
    return text.replace('"traceEvents"', '"traceEvents_"', 1)  # not a trace


def _rlimits() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_CAP_S, CPU_CAP_S))


def test_mutated_traces_never_stop_or_exhaust_the_analyzer(tmp_path: Path):
    gen = tmp_path / "gen"
    gen_traces.generate(["--out", str(gen), "--ranks", "2", "--pp", "2", "--layers", "1",
                         "--steps", "2", "--no-gzip"])  # fmt: skip
    sources = [(gen / f"rank-{r}.json").read_text() for r in range(2)]
    for r in (0, 1):
        with gzip.open(DATA / f"trace_filter/sampled_rank-{r}.json.gz", "rt") as fh:
            sources.append(fh.read())
    rng = random.Random(SEED)
    d = tmp_path / "fuzz"
    d.mkdir()
    names = []
    for i in range(MUTANTS):
        text = _mutate(rng.choice(sources), rng)
        name = f"rank-{i}.json" + (".gz" if i % 3 == 0 else "")
        data = text.encode("utf-8", "surrogatepass")
        (d / name).write_bytes(
            gzip.compress(data)[: None if i % 7 else -50] if i % 3 == 0 else data
        )
        names.append(name)
    out = tmp_path / "o"
    run = subprocess.run(
        [sys.executable, "-m", "titan_trace_analysis.cli", "analyze", str(d), "--out", str(out),
         "--no-progress", "--workers", "1"],
        capture_output=True, text=True, timeout=300, preexec_fn=_rlimits,
    )  # fmt: skip
    assert run.returncode in (0, 1, 3), run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "\x1b" not in run.stdout
    report = json.loads((out / "report.json").read_text(), parse_constant=_reject)
    seen = {Path(r["file"]).name for r in report["ranks"].values()}
    seen |= {Path(p["file"]).name for p in report["problems"]}
    assert set(names) <= seen  # every file analysed or reported
    assert (out / "report.html").stat().st_size > 0


def _reject(name: str) -> None:
    raise AssertionError(f"{name} in report.json")
