"""Activation overhead: ``import torch`` and ``import megatron.core`` with the core and every
installed plugin active, versus ``TITAN_PLUGINS=0``, interleaved in one invocation.

Goal (issue 2): ratio <= 1.01. Each sample is a fresh interpreter timing its own import with
``time.perf_counter`` (interpreter start-up is excluded); runs alternate on/off so machine load
drifts hit both sides alike, and the side that runs first alternates. Prints the medians and the
ratios, and the overhead measured inside the plugins-on processes (time in the activation and
in patch application against the rest of the import), which whole-import noise does not blur;
the verdict rests on that in-process overhead unless the whole imports' paired ratios
refute it (their 95% interval wholly above the goal).
The core and plugins are byte-compiled first, as a wheel install does.

    .venv/bin/python benchmarks/activation_overhead.py --runs 15
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

import loadguard
from intervals import median_interval

SNIPPET = """
import json, time
t0 = time.perf_counter()
import {module}
t1 = time.perf_counter()
state = None
titan = 0.0
try:
    # read before anything else runs: the report below may itself look megatron up
    from titan_plugins import activation, autoload
    armed, act = autoload.armed(), activation.current()
    if armed is not None and act is not None and act.engine is not None:
        titan = armed.fire_seconds + act.engine.apply_seconds - act.applied_while_starting
        # The watcher is asked about every module imported after activation; it cannot time
        # itself without adding to that cost, so time its check here and count the imports.
        import sys
        n = 5000
        t = time.perf_counter()
        for _ in range(n):
            act.watcher.find_spec("not.watched.module")
        titan += (time.perf_counter() - t) / n * len(sys.modules)
    from titan_plugins import report
    data = report.collect()
    state = {{"active": data["active"], "plugins": [p["name"] for p in data["plugins"] if p["state"] == "enabled"]}}
except Exception as err:
    state = {{"error": str(err)}}
print(json.dumps({{"seconds": t1 - t0, "titan": titan, "state": state}}))
"""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample(module: str, env_extra: dict[str, str]) -> dict:
    """Time one import of ``module`` in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    env.update(env_extra, TORCH_COMPILE_DISABLE="1", PYTHONWARNINGS="ignore")
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET.format(module=module)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_sources() -> None:
    """Byte-compile the core and plugins, as a wheel install does (an editable install leaves
    that to the first import, and PYTHONDONTWRITEBYTECODE makes every process compile again)."""
    # the same folders as scripts/bootstrap.sh's compile_sources
    dirs = [os.path.join(ROOT, "titan_plugins")]
    dirs += sorted(glob.glob(os.path.join(ROOT, "plugins", "*", "titan_*")))
    subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True)
    print("byte-compiled the core and plugins first (as a wheel install does)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=11, help="samples per side and module")
    loadguard.add_arguments(parser)
    args = parser.parse_args()
    print(loadguard.describe(args))
    compile_sources()
    for module in ("torch", "megatron.core"):
        on: list[float] = []
        off: list[float] = []
        titan: list[float] = []
        state_on = state_off = None
        for index in range(args.runs):
            # alternate which side runs first: the first of a pair meets a colder page cache
            if index % 2:
                b = sample(module, {"TITAN_PLUGINS": "0"})
                a = sample(module, {})
            else:
                a = sample(module, {})
                b = sample(module, {"TITAN_PLUGINS": "0"})
            on.append(a["seconds"])
            off.append(b["seconds"])
            titan.append(a["titan"])
            state_on, state_off = a["state"], b["state"]
        med_on, med_off = statistics.median(on), statistics.median(off)
        # Adjacent samples share the machine's momentary load: the median of their ratios is
        # steadier than the ratio of the medians; both are printed.
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        paired = statistics.median(ratios)
        # The same overhead measured inside each plugins-on process: the time spent in the
        # activation at the trigger and in judging / applying patches, against the rest of that
        # import (whole imports vary by several % from run to run on a shared machine; this does
        # not), plus the watcher's check on each import, timed and counted in that process
        # (counted for every module in sys.modules, torch's too: an upper bound).
        inside = 1 + statistics.median(t / (s - t) for t, s in zip(titan, on, strict=True))
        low, high, coverage = median_interval(ratios)
        # The in-process figure is the measurement (it counts what the plugins add: activation,
        # patching, the watcher's check on each later import); the whole-import ratios vary by
        # +-10% here (the machine's speed drifts between runs) and can only refute it: the
        # verdict fails when the paired ratios' interval lies wholly above the goal. That test
        # is weak (with 11 runs it fails only when 10 of 11 ratios exceed the goal), so the
        # verdict rests in practice on the in-process figure; for ``import torch``, where
        # nothing of the plugins runs, on the whole-import interval alone.
        met = inside <= 1.01 and low <= 1.01
        print(
            f"import {module}: plugins on {med_on * 1e3:.1f} ms, TITAN_PLUGINS=0 {med_off * 1e3:.1f} ms, "
            f"ratio of medians {med_on / med_off:.3f}, median of paired ratios {paired:.3f} "
            f"({coverage:.1%} interval {low:.3f}-{high:.3f}), in-process {inside:.3f} (titan "
            f"{statistics.median(titan) * 1e3:.1f} ms; median of {args.runs}); goal <= 1.01: "
            f"{loadguard.verdict(met, args)}"
        )
        print(f"    on: {state_on}\n    off: {state_off}")
    print(loadguard.describe(args))


if __name__ == "__main__":
    main()
