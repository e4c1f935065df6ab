"""``titan-plugins verify``: check the installed plugins against the Megatron this environment
imports, before a job spends GPU hours on it.

Today it runs the differential training check (:mod:`titan_plugins.verify.differential`) on the
installed Megatron, or on a checkout's (``--megatron-lm DIR``), and prints, per plugin: each
layout's largest loss and grad-norm gap from the run with every plugin off, the work it counted,
and a verdict. Running the checkout's own ``tests/unit_tests`` for each patched area, plugins off
and on, is not built yet, and the output says so. The exit status is 0 when every plugin passed,
1 when one failed, 2 for bad arguments, 3 when ``--budget-min`` left runs out (INCOMPLETE).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

EXIT = {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}
"""Exit status per verdict (2: bad arguments)."""
UPSTREAM_NOT_RUN = (
    "Megatron-LM's own unit tests were not run: they need a Megatron-LM checkout (the wheel "
    "ships none), and running them from one is not built yet"
)
UPSTREAM_NOT_BUILT = (
    "the checkout's own unit tests were not run: running them is not built yet (only the "
    "differential check trained with its megatron)"
)


def parser() -> argparse.ArgumentParser:
    """The ``verify`` arguments."""
    p = argparse.ArgumentParser(
        prog="titan-plugins verify",
        description="Train a tiny MoE GPT on the installed Megatron with every plugin off, each "
        "alone and all on (4 local gloo processes, CPU) and judge each plugin.",
    )
    p.add_argument("--only", default="", help="comma list of plugins (default: every installed)")
    p.add_argument(
        "--layouts", default="", help="comma list of layouts: pp2xep2, pp2xvpp2 (default: both)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--timeout-min", type=float, default=30.0, help="per training run (default: 30)")
    p.add_argument(
        "--budget-min",
        type=float,
        default=None,
        help="start no training run after N minutes; the rest is reported as not run",
    )
    p.add_argument(
        "--megatron-lm",
        metavar="DIR",
        default=None,
        help="train with this Megatron-LM checkout's megatron instead of the installed one",
    )
    return p


def main(argv: list[str]) -> int:
    """Run the check; print the table; 0 when every plugin passed."""
    from titan_plugins.verify import differential

    args = parser().parse_args(argv)
    names = [n for n in args.only.split(",") if n] or None
    layouts = [n for n in args.layouts.split(",") if n] or None
    try:
        result = differential.run(
            names,
            layouts,
            timeout_s=args.timeout_min * 60,
            budget_s=None if args.budget_min is None else args.budget_min * 60,
            megatron_lm=args.megatron_lm,
        )
    except ValueError as err:
        print(f"titan-plugins verify: {err}", file=sys.stderr)
        return 2
    upstream = UPSTREAM_NOT_BUILT if args.megatron_lm else UPSTREAM_NOT_RUN
    print_table(result, sys.stdout, upstream)
    if args.json:
        document = as_json(result, upstream)
        Path(args.json).write_text(json.dumps(document, indent=2, default=str) + "\n")
    return EXIT[result.verdict]


def as_json(result: Any, upstream: str = UPSTREAM_NOT_RUN) -> dict[str, Any]:
    """The JSON document: per plugin, the upstream-test counts (none run yet), its regressions
    (the differential check's failures) and what was not judged; the check itself."""
    plugins = {}
    for name, verdict in result.plugins.items():
        plugins[name] = {
            "selected": 0,
            "ran_off": 0,
            "ran_on": 0,
            "passed_off": 0,
            "passed_on": 0,
            "regressions": [f"differential: {p}" for p in verdict.problems],
            "not_judged": [
                *verdict.not_judged,
                {"test": "megatron_lm_tests", "why": upstream},
            ],
        }
    return {"plugins": plugins, "differential": result.as_dict(), "seconds": result.seconds}


def print_table(result: Any, out: TextIO, upstream: str = UPSTREAM_NOT_RUN) -> None:
    """One block per plugin, then the all-on runs and the verdict."""
    print(f"differential training check ({result.seconds:.0f} s)", file=out)
    print(f"megatron: {result.megatron}", file=out)
    for name, verdict in result.plugins.items():
        print(f"- {name}: {verdict.label}", file=out)
        for layout, run in verdict.runs.items():
            bound = f"bound {verdict.loss_bound:g}" if verdict.loss_bound else "bit-identical"
            work = sum(1 for v in run["effects"].get(name, {}).values() if v)
            print(f"    {layout}: {_gaps(run)} ({bound}); {work} counters moved", file=out)
        for skipped in verdict.not_judged:
            print(f"    not judged {skipped['test']}: {skipped['why']}", file=out)
        for problem in verdict.problems:
            print(f"    problem: {problem}", file=out)
    for layout, run in result.all_on.items():
        print(f"- all on, {layout}: {_gaps(run)}", file=out)
    for problem in result.problems:
        print(f"  problem: {problem}", file=out)
    if result.not_run:
        print(f"not run (time budget): {', '.join(result.not_run)}", file=out)
    print(f"note: {upstream}", file=out)
    print(f"verdict: {result.verdict}", file=out)


def _gaps(run: dict[str, Any]) -> str:
    return f"loss gap {run['max_loss_gap']:.3g}, grad-norm gap {run['max_norm_gap']:.3g}"
