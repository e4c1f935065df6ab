"""``titan-plugins verify``: check the installed plugins against the Megatron this environment
imports, before a job spends GPU hours on it.

With ``--megatron-lm DIR`` it first runs the checkout's own ``tests/unit_tests`` files that cover
each plugin's patch targets, plugins off and on, on CPU and gloo at the world sizes the files
are written for (:mod:`titan_plugins.verify.upstream`). Then, with or without a checkout, the
differential training check (:mod:`titan_plugins.verify.differential`) trains with that
checkout's megatron (or the installed one). It prints, per plugin: the upstream tests selected,
run and passed in each mode, the regressions and what was not judged; each layout's largest loss
and grad-norm gap from the run with every plugin off and the work it counted; and a verdict.
The exit status is 0 when every plugin passed, 1 when one failed, 2 for bad arguments, 3 when
``--budget-min`` left runs out (INCOMPLETE), 4 when the verdict printed could not be written to
``--json FILE`` (checked writable before any run; it went away during the run), 130 when
interrupted (Ctrl-C: every process verify started is stopped, one line says so, and ``--json
FILE`` is written whole or not at all).

What the workers print reaches the terminal less the native libraries' start-up chatter
(:mod:`~titan_plugins.verify.relay`); ``--verbose`` shows every line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from titan_plugins import native_noise

if TYPE_CHECKING:
    from titan_plugins.verify.children import Before

EXIT = {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}
"""Exit status per verdict (2: bad arguments, :data:`NOT_WRITTEN`)."""
BAD_ARGUMENTS = 2
NOT_WRITTEN = 4
"""The verdict was printed but ``--json FILE`` could not be written: never 1, no plugin failed."""
UPSTREAM_NOT_RUN = (
    "Megatron-LM's own unit tests were not run: they need a Megatron-LM checkout (the wheel "
    "ships none); pass --megatron-lm DIR"
)
REASONS_SHOWN = 3
"""The most frequent reasons a plugin's upstream tests were not judged, printed per plugin (the
JSON has every test)."""


def parser() -> argparse.ArgumentParser:
    """The ``verify`` arguments."""
    p = argparse.ArgumentParser(
        prog="titan-plugins verify",
        description="With --megatron-lm, run the checkout's own unit tests for every patched "
        "area with the plugins off and on; then train a tiny MoE GPT with every plugin off, each "
        "alone and all on (4 local gloo processes, CPU) and judge each plugin.",
    )
    p.add_argument("--only", default="", help="comma list of plugins (default: every installed)")
    p.add_argument(
        "--layouts",
        default="",
        help="comma list of layouts: pp2xep2, pp2xvpp2 (the MoE GPT), kimi_pp2xep2 (Kimi-K2's "
        "architecture: MLA, shared expert) (default: all three)",
    )
    p.add_argument(
        "--world-sizes",
        default="",
        help="comma list: run the upstream tests only at these numbers of ranks (default: the "
        "ones each test file is written for)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument(
        "--timeout-min",
        type=float,
        default=30.0,
        help="per training run and per upstream test job (default: 30)",
    )
    p.add_argument(
        "--budget-min",
        type=float,
        default=None,
        help="start no run or test job after N minutes; the rest is reported as not run",
    )
    p.add_argument(
        "--megatron-lm",
        metavar="DIR",
        default=None,
        help="a Megatron-LM checkout: run its unit tests, and train with its megatron instead of "
        "the installed one",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every line the workers' libraries print (by default their start-up chatter "
        "is left out, titan_plugins/native_noise.py)",
    )
    return p


def world_sizes(text: str) -> list[int] | None:
    """``--world-sizes``: None when empty.

    :raises ValueError: a value that is not a positive whole number.
    """
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--world-sizes: {part!r} is not a number of ranks (e.g. 1,2,4,8)")
        sizes.append(int(part))
    return sizes or None


def minutes(flag: str, value: float | None) -> None:
    """``--budget-min`` / ``--timeout-min``: None (not given) or a number of minutes above 0.

    :raises ValueError: zero, negative, ``nan`` or ``inf``.
    """
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag}: {value:g} is not a number of minutes above 0 (e.g. {flag} 20)")


def writable(path: str) -> None:
    """``--json FILE``: a file that can be written (its folder exists, it is no folder).

    :raises ValueError: a missing folder, a folder, or a path this process cannot write.
    """
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"--json {path}: is a folder; name a file in it, e.g. {target / 'v.json'}")
    if not folder.is_dir():
        raise ValueError(f"--json {path}: no folder {folder}; create it first or name another")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise ValueError(f"--json {path}: not writable by this user; name a file you can write")


def checked(args: argparse.Namespace) -> None:
    """Every argument that can be judged before any run.

    :raises ValueError: the first bad one (one line, naming the fix).
    """
    minutes("--budget-min", args.budget_min)
    minutes("--timeout-min", args.timeout_min)
    if args.world_sizes and not args.megatron_lm:
        raise ValueError(
            "--world-sizes chooses the ranks of Megatron-LM's unit tests, which run only with a "
            "checkout: add --megatron-lm DIR, or leave --world-sizes out"
        )
    if args.json:
        writable(args.json)


def main(argv: list[str]) -> int:
    """Run the checks; print the table; 0 when every plugin passed, 130 when interrupted."""
    from titan_plugins.verify import children, interrupt

    args = parser().parse_args(argv)
    was = children.before()  # what ran before: an in-process caller's own pools stay
    written: list[str] = []
    with interrupt.handled(lambda: children.stop_all(was)) as state:
        try:
            return _checked_run(args, was, written)
        except BaseException:
            if not state.interrupted:
                raise
            children.stop_all(was)  # anything started after the handler ran
            message = interrupt.MESSAGE
            if written:  # the Ctrl-C came after the verdict was written whole
                message = message.replace("nothing written", f"--json {written[0]} was written")
            print(message, file=sys.stderr, flush=True)
            return interrupt.STATUS


def _checked_run(args: argparse.Namespace, was: Before, written: list[str]) -> int:
    """The checks, the table and the JSON file (``written`` gets its path once it is whole)."""
    from titan_plugins.verify import children, differential, relay, upstream

    names = [n for n in args.only.split(",") if n] or None
    layouts = [n for n in args.layouts.split(",") if n] or None
    budget_s = None if args.budget_min is None else args.budget_min * 60
    started = time.monotonic()
    tests = None
    try:
        checked(args)
        sizes = world_sizes(args.world_sizes)
        with relay.Relay(args.verbose) as relayed:
            try:
                if args.megatron_lm:
                    checkout = Path(differential.checkout(args.megatron_lm))
                    packages = differential.chosen(names)
                    tests = upstream.run(packages, checkout, sizes, args.timeout_min * 60, budget_s)
                left = (
                    None if budget_s is None else max(0.0, budget_s - (time.monotonic() - started))
                )
                result = differential.run(
                    names, layouts, args.timeout_min * 60, left, megatron_lm=args.megatron_lm
                )
            finally:
                children.stop_helpers(was)  # before the relay ends: its pipes close with them
    except ValueError as err:
        print(f"titan-plugins verify: {err}", file=sys.stderr)
        return BAD_ARGUMENTS
    print_table(result, sys.stdout, tests)
    closing = native_noise.summary(relayed.dropped)
    if closing:
        print(closing, file=sys.stderr)
    if args.json:
        document = as_json(result, tests)
        try:
            write_whole(args.json, json.dumps(document, indent=2, default=str) + "\n")
        except OSError as err:  # writable before the run; e.g. its folder went away since
            print(
                f"titan-plugins verify: the verdict above was not written to --json {args.json}: "
                f"{err.strerror or err}; run again with a file you can write",
                file=sys.stderr,
            )
            return NOT_WRITTEN
        written.append(args.json)
    return EXIT[verdict(result, tests)]


def write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file in the same folder,
    then renamed over ``path`` (one step), so a Ctrl-C or a full disk leaves no partial file.

    :raises OSError: the folder cannot be written (the temporary file is removed).
    """
    target = Path(path)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(out.fileno(), 0o666 & ~umask)  # as a plain write creates it, not 0600
            out.write(text)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def verdict(result: Any, tests: Any = None) -> str:
    """The whole run: FAIL (a regression or a differential problem), INCOMPLETE (runs or test
    jobs left out by the budget, or a plugin whose selected upstream tests judged nothing, e.g.
    the checkout's conftest does not import here), PASS."""
    mine = [] if tests is None else list(tests.plugins.values())
    if result.verdict == "FAIL" or any(p.verdict == "FAIL" for p in mine):
        return "FAIL"
    unjudged = any(p.verdict == "NOT JUDGED" and not p.declared_none for p in mine)
    if result.verdict == "INCOMPLETE" or unjudged or (tests is not None and tests.not_run):
        return "INCOMPLETE"
    return "PASS"


def as_json(result: Any, tests: Any = None) -> dict[str, Any]:
    """The JSON document: per plugin, the upstream-test counts, its regressions (upstream tests
    and the differential check's failures) and what was not judged; both checks in full."""
    plugins = {}
    for name, judged in result.plugins.items():
        mine = tests.plugins.get(name) if tests is not None else None
        counts = {
            key: getattr(mine, key) if mine else 0
            for key in ("selected", "ran_off", "ran_on", "passed_off", "passed_on", "passed_both")
        }
        plugins[name] = {
            **counts,
            "regressions": [
                *(mine.regressions if mine else []),
                *(f"differential: {p}" for p in judged.problems),
            ],
            "not_judged": [
                *(
                    mine.not_judged
                    if mine
                    else [{"test": "megatron_lm_tests", "why": UPSTREAM_NOT_RUN}]
                ),
                *judged.not_judged,
            ],
        }
    return {
        "plugins": plugins,
        "upstream": tests.as_dict() if tests is not None else None,
        "differential": result.as_dict(),
        "verdict": verdict(result, tests),
        "seconds": result.seconds + (tests.seconds if tests is not None else 0.0),
    }


def print_table(result: Any, out: TextIO, tests: Any = None) -> None:
    """The upstream tests per plugin (with a checkout), then the differential check: one block
    per plugin, the all-on runs; then the verdict."""
    if tests is not None:
        print_upstream(tests, out)
    print(f"differential training check ({result.seconds:.0f} s)", file=out)
    print(f"megatron: {result.megatron}", file=out)
    for name, judged in result.plugins.items():
        print(f"- {name}: {judged.label}", file=out)
        for layout, run in judged.runs.items():
            bound = f"bound {judged.loss_bound:g}" if judged.loss_bound else "bit-identical"
            work = sum(1 for v in run["effects"].get(name, {}).values() if v)
            print(f"    {layout}: {_gaps(run)} ({bound}); {work} counters moved", file=out)
        for skipped in judged.not_judged:
            print(f"    not judged {skipped['test']}: {skipped['why']}", file=out)
        for problem in judged.problems:
            print(f"    problem: {problem}", file=out)
    for layout, run in result.all_on.items():
        print(f"- all on, {layout}: {_gaps(run)}", file=out)
    for problem in result.problems:
        print(f"  problem: {problem}", file=out)
    if result.not_run:
        print(f"not run (time budget): {', '.join(result.not_run)}", file=out)
    if tests is None:
        print(f"note: {UPSTREAM_NOT_RUN}", file=out)
    print(f"verdict: {verdict(result, tests)}", file=out)


def print_upstream(tests: Any, out: TextIO) -> None:
    """Per plugin: counts per mode, every regression, the commonest reasons not judged."""
    print(f"Megatron-LM unit tests, plugins off vs on ({tests.seconds:.0f} s)", file=out)
    print(f"megatron: {tests.megatron}", file=out)
    for name, mine in tests.plugins.items():
        print(
            f"- {name}: {mine.verdict}: {mine.selected} selected; off: {mine.passed_off}/"
            f"{mine.ran_off} passed; on: {mine.passed_on}/{mine.ran_on} passed; "
            f"{mine.passed_both} passed in both; {len(mine.regressions)} regressions; "
            f"{len(mine.not_judged)} not judged",
            file=out,
        )
        for regression in mine.regressions:
            print(f"    regression: {regression}", file=out)
        reasons = Counter(_reason(entry["why"]) for entry in mine.not_judged)
        for why, count in reasons.most_common(REASONS_SHOWN):
            print(f"    not judged ({count}): {why}", file=out)
    for job in tests.launches:
        if job.problem:
            print(f"  {job.world_size} ranks, plugins {job.mode}: {job.problem}", file=out)
            print("    " + job.log_tail.rstrip().replace("\n", "\n    "), file=out)
    if tests.not_run:
        print(f"not run (time budget): {'; '.join(tests.not_run)}", file=out)


def _reason(why: str) -> str:
    """A not-judged reason without its rank prefix, cut to one line (for counting)."""
    return why.split(": ", 1)[1] if why.startswith("rank ") else why


def _gaps(run: dict[str, Any]) -> str:
    return f"loss gap {run['max_loss_gap']:.3g}, grad-norm gap {run['max_norm_gap']:.3g}"
