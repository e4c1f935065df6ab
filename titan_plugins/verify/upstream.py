"""Megatron-LM's own unit tests for every patched area, plugins off and on (``titan-plugins
verify --megatron-lm DIR``).

Each plugin's data file (``upstream_tests.json``, :mod:`~titan_plugins.verify.selection`) names
the files under a checkout's ``tests/unit_tests/`` whose tests call its patch targets, and the
numbers of ranks they are written for. The union of the selected plugins' files runs once per
world size with every plugin off (``TITAN_PLUGINS=0``) and once with the selected plugins on
(``TITAN_PLUGINS_ONLY``), each time as one job of that many local processes on CPU and gloo
(:mod:`~titan_plugins.testing.upstream_worker`: one pytest per rank, the process group the tests'
own ``Utils`` builds reused across the files). A test's outcome is the worst over the ranks.

Per plugin, over its own files: tests selected, run and passed in each mode, and

- a **regression**: a test that passed with the plugins off and did not with them on (failed,
  errored, or was never reached because the run hung or crashed), or one that only runs with the
  plugins on (a backend a plugin binds, e.g. the DeepEP dispatcher cases) and fails;
- **not judged**, with the reason: skipped in either mode (a test that needs Transformer Engine),
  failing with the plugins off too (the CPU harness cannot serve it), a file this checkout lacks,
  a world size not given, a run the time budget left out. Never counted as passed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from titan_plugins import native_noise
from titan_plugins.hosts import HOSTS
from titan_plugins.manager import ENABLED
from titan_plugins.testing.upstream_worker import FAILED, MEGATRON, PASSED, SKIP_ENV, SKIPPED
from titan_plugins.verify import conftest_needs, interrupt, selection

SUITE = "megatron_lm_tests"
OFF, ON = "off", "on"
MISSING = "missing"
"""A test the other mode ran that this mode never reached (its run hung or crashed first)."""
_RANK = {PASSED: 0, SKIPPED: 1, FAILED: 2}  # the worst outcome over phases and ranks wins
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCH_COMPILE_DISABLE": "1",  # the workers answer is_available() True (upstream_worker)
    "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the user's checkout
}
LOG_TAIL_CHARS = 2000
TOO_FEW_RANKS = re.compile(r"world_size \(\d+\) is not divisible by")
"""Megatron's own refusal of a parallel layout larger than the job (``parallel_state``): a
parametrized case written for more ranks, not a plugin's failure."""
STALL_S = 120.0
"""A job in which no rank records anything for this long, once tests run, is hung: the test
each rank is in fails as hung and the job goes on without it."""
HUNG = "hung: "
"""How a hung test's first error line starts."""
TEST_REQUIREMENTS = ("pytest", "pytest_mock", "six", "regex", "pydantic")
"""What the workers need to run the upstream files (the ``verify`` extra): pytest-mock for the
tests' ``mocker``; six, regex and pydantic for the conftest of core_v0.16-line checkouts (it
reaches ``megatron.training``, whose tokenizers and arguments import them). What a checkout's
own conftest chain imports (click, requests, triton, yaml on the served lines) is checked per
checkout (:mod:`~titan_plugins.verify.conftest_needs`) before any job."""
PYTEST_ENDED = (0, 1, 5)
"""pytest's exit statuses of a session that ran to its end: all passed, some failed, none
collected. Anything else (interrupted, internal error, a signal) is a crash."""


@dataclass(frozen=True)
class Outcome:
    """A test's merged outcome over the ranks; ``why``: the skip reason or first error line."""

    status: str
    why: str = ""


@dataclass
class Launch:
    """One job: the files at one world size in one mode."""

    world_size: int
    mode: str
    files: list[str]
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per plugin active in the job: its state on rank 0 and its patch ids applied or failed
    on any rank (:func:`~titan_plugins.testing.upstream_worker.plugin_states`)."""
    states_seen: bool = False  # a rank reached the end of its session and reported them
    megatron: str = ""
    """The Megatron its ranks imported (``megatron-core <version> from <folder>``)."""
    seconds: float = 0.0
    hung: list[str] = field(default_factory=list)  # tests left out for hanging (failed)
    problem: str = ""  # a hang or crash, with the test each rank was in (one line)
    log_tail: str = ""  # the end of the first such rank's output

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "mode": self.mode,
            "files": self.files,
            "tests": len(self.outcomes),
            "plugins": self.plugins,
            "megatron": self.megatron,
            "seconds": round(self.seconds, 1),
            "problem": self.problem,
            "log_tail": self.log_tail,
        }


@dataclass
class PluginTests:
    """One plugin's upstream tests, counted over its own files and world sizes."""

    name: str
    selected: int = 0
    ran_off: int = 0
    ran_on: int = 0
    passed_off: int = 0
    passed_on: int = 0
    passed_both: int = 0
    regressions: list[str] = field(default_factory=list)
    not_judged: list[dict[str, str]] = field(default_factory=list)
    declared_none: bool = False
    """Its data file selects no upstream file and says why (nothing was expected to run)."""

    @property
    def verdict(self) -> str:
        """FAIL with a regression; NOT JUDGED when no test passed in both modes (every job
        crashed before its tests, every test skipped, no file in this checkout): never a PASS
        on nothing; else PASS."""
        if self.regressions:
            return "FAIL"
        return "PASS" if self.passed_both else "NOT JUDGED"


@dataclass
class UpstreamResult:
    """Every plugin's counts, the jobs run and what the budget left out."""

    plugins: dict[str, PluginTests]
    launches: list[Launch]
    not_run: list[str]
    seconds: float

    @property
    def megatron(self) -> str:
        """The Megatron the jobs' ranks imported (each one once)."""
        seen = sorted({job.megatron for job in self.launches if job.megatron})
        return "; ".join(seen) or "unknown (no rank got to its tests)"

    def as_dict(self) -> dict[str, Any]:
        return {
            "megatron": self.megatron,
            "plugins": {
                name: {**asdict(p), "verdict": p.verdict} for name, p in self.plugins.items()
            },
            "launches": [launch.as_dict() for launch in self.launches],
            "not_run": self.not_run,
            "seconds": round(self.seconds, 1),
        }


# ---------------------------------------------------------------------------- planning
@dataclass
class Plan:
    """What runs: world size -> the files (the union over plugins), and per plugin the (file,
    world size) pairs it is judged on and what it cannot be judged on."""

    launches: dict[int, list[str]] = field(default_factory=dict)
    judged_on: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    not_judged: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    declared_none: set[str] = field(default_factory=set)
    """The plugins whose data file selects no upstream file (its ``not_covered`` says why)."""


def suite_host() -> Any:
    """The host room whose checkouts hold :data:`SUITE` (its package ships the core's own data
    file: the files its patches are tested by)."""
    return next(host for host in HOSTS.values() if SUITE in host.UPSTREAM_TESTS)


def through_core(names: Iterable[str]) -> set[str]:
    """The plugins of ``names`` that implement a Megatron training-step hook: they act through
    the core's patches (the step, microbatch and optimizer wrappers), so the files the core's
    data file selects exercise them too."""
    from titan_plugins import manager

    hooks = getattr(suite_host(), "WRAPPER_HOOKS", ())
    wanted, out = set(names), set()
    for ep in manager.discover():
        if ep.name not in wanted:
            continue
        try:
            plugin = ep.load()
        except Exception:  # noqa: BLE001 (a plugin that does not import: the jobs name it)
            continue
        if any(hasattr(plugin, hook) for hook in hooks):
            out.add(ep.name)
    return out


def plan(
    packages: dict[str, str],
    checkout: Path,
    world_sizes: Iterable[int] | None = None,
    core_users: Iterable[str] = (),
) -> Plan:
    """The runs for the plugins ``packages`` (name -> package) against ``checkout``.

    :param world_sizes: run only at these numbers of ranks (default: each file's own).
    :param core_users: plugins also judged on the core's selected files (:func:`through_core`).
    :raises ValueError: a plugin's data file with a bad field.
    """
    allowed = None if world_sizes is None else set(world_sizes)
    users = set(core_users)
    out = Plan()
    for name, package in packages.items():
        judged, skipped = out.judged_on.setdefault(name, []), out.not_judged.setdefault(name, [])
        tests, why_not = _selected(package, skipped)
        if name in users:
            own = {t.path for t in tests}
            core = suite_host().__name__
            tests += [t for t in _selected(core, skipped)[0] if t.path not in own]
        if not tests and not skipped:  # (a package with no data file is noted already)
            skipped.append(
                {"test": SUITE, "why": "no upstream test file selected for it" + why_not}
            )
            out.declared_none.add(name)
        for test in tests:
            if not (checkout / test.path).is_file():
                skipped.append({"test": test.path, "why": "not in this checkout"})
                continue
            declared = test.world_sizes or (1,)
            sizes = [n for n in declared if allowed is None or n in allowed]
            if not sizes:
                skipped.append(
                    {
                        "test": test.path,
                        "why": f"written for {', '.join(map(str, declared))} ranks; "
                        f"--world-sizes gave {', '.join(map(str, sorted(allowed or ())))}",
                    }
                )
            for size in sizes:
                judged.append((test.path, size))
                files = out.launches.setdefault(size, [])
                if test.path not in files:
                    files.append(test.path)
    out.launches = dict(sorted(out.launches.items()))
    return out


def _selected(
    package: str, skipped: list[dict[str, str]]
) -> tuple[list[selection.UpstreamTest], str]:
    """The suite's files a package's data file selects (none, noted, when it ships none), and
    what its data file says of the patches no file covers (``"; not covered: ..."``).

    :raises ValueError: a data file with a bad field.
    """
    try:
        found = selection.load(package)
    except selection.SelectionError as err:
        if "no upstream_tests.json" not in str(err):
            raise ValueError(str(err)) from None
        skipped.append({"test": SUITE, "why": f"{package} ships no {selection.DATA_FILE}"})
        return [], ""
    why_not = "; ".join(f"{pid}: {why}" for pid, why in found.not_covered.items())
    return [
        t for t in found.tests if t.suite == SUITE
    ], f"; not covered: {why_not}" if why_not else ""


# ---------------------------------------------------------------------------- running
def launch(
    checkout: Path,
    files: list[str],
    world_size: int,
    mode: str,
    env: dict[str, str],
    timeout_s: float,
    stall_s: float = STALL_S,
) -> Launch:
    """Run ``files`` as one job of ``world_size`` local processes under ``env`` (the switches
    of ``mode``); merge their outcomes.

    A test that hangs (no rank records anything for ``stall_s``: a collective whose peers never
    come, e.g. megatron's batched P2P under VPP on gloo) fails as hung, and the job starts again
    without it and without the tests already done, so one hang costs one test, not the file.
    Past ``timeout_s`` the job is given up and the tests not reached are missing.
    """
    job = Launch(world_size, mode, list(files))
    started = time.monotonic()
    hung: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="titan-verify-upstream-") as folder:
        scratch = Path(folder)
        records = [scratch / f"rank{rank}.jsonl" for rank in range(world_size)]
        skip = scratch / "skip.txt"
        skip.write_text("")
        for attempt in itertools.count():
            procs: list[subprocess.Popen[bytes]] = []
            try:
                _start(
                    procs,
                    checkout,
                    files,
                    world_size,
                    {**env, SKIP_ENV: str(skip)},
                    scratch,
                    attempt,
                )
                ended = _wait(procs, records, started + timeout_s, stall_s)
            except BaseException:  # a Ctrl-C or an error here: no rank outlives its job
                _kill(procs)
                raise
            per_rank = [_read(path) for path in records]
            running = [test for _, test, _ in per_rank]
            if ended or not any(running) or time.monotonic() > started + timeout_s:
                break
            for rank, test in enumerate(running):
                if test and test not in hung:
                    hung[test] = (
                        f"{HUNG}no rank recorded anything for {stall_s:.0f} s (rank {rank} was "
                        "in it); the job went on without it"
                    )
            done = {test for outcomes, _, _ in per_rank for test in outcomes} | set(hung)
            skip.write_text("\n".join(sorted(done)))
        job.outcomes = merge([outcomes for outcomes, _, _ in per_rank])
        job.outcomes.update({test: Outcome(FAILED, why) for test, why in hung.items()})
        job.hung = sorted(hung)
        job.plugins = _states([states for _, _, states in per_rank if states is not None])
        job.states_seen = any(states is not None for _, _, states in per_rank)
        job.megatron = "; ".join(sorted({m for path in records for m in _megatron_of(path)}))
        job.problem, job.log_tail = _problem(procs, ended, running, scratch / f"{attempt}")
        if hung and not job.problem:
            job.problem = f"{len(hung)} test(s) hung and were left out: {', '.join(sorted(hung))}"
    job.seconds = time.monotonic() - started
    return job


def retry_hung(
    checkout: Path, job: Launch, env: dict[str, str], timeout_s: float, stall_s: float = STALL_S
) -> None:
    """Each test that hung in ``job`` runs again alone, in a fresh job of as many ranks under
    the same switches; what it does there is its outcome.

    The stall rule cannot tell a hang from a test slowed past ``stall_s`` by the machine's load
    (8 ranks on 2 cores), and a test that stalled in one mode only would read as a regression
    (measured: ``test_shared_experts.py``'s first case stalled in full runs at 8 ranks and
    passed alone). A real hang (a collective whose peers never come) hangs alone too
    and stays failed. The test's ``why`` says it ran again; ``job.problem`` names what was
    re-run, and ``job.hung`` keeps the tests that hung again.
    """
    if not job.hung:
        return
    again = launch(checkout, job.hung, job.world_size, job.mode, env, timeout_s, stall_s)
    job.seconds += again.seconds
    job.problem += f"; run again alone: {', '.join(job.hung)}"
    still = []
    for test in job.hung:
        found = again.outcomes.get(test)
        if found is None or test in again.hung:
            job.outcomes[test] = Outcome(FAILED, f"{job.outcomes[test].why}; hung again alone")
            still.append(test)
            continue
        note = f"hung in the full job; run again alone: {found.status}"
        job.outcomes[test] = Outcome(found.status, f"{note}: {found.why}" if found.why else note)
    job.hung = still


def _start(
    procs: list[subprocess.Popen[bytes]],
    checkout: Path,
    files: list[str],
    world_size: int,
    env: dict[str, str],
    scratch: Path,
    attempt: int,
) -> None:
    """The job's ranks, appended to ``procs`` as each starts (a caller that stops them sees every
    one), each appending to ``rank<N>.jsonl``; output in ``<attempt>.rank<N>.log``.

    Started with SIGINT blocked: a terminal's Ctrl-C reaches verify alone, which kills the ranks
    (:mod:`~titan_plugins.verify.interrupt`) instead of each printing its own KeyboardInterrupt.
    """
    port = _free_port()
    with interrupt.shielded():
        for rank in range(world_size):
            rank_env = {
                **os.environ,
                **WORKER_ENV,
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with open(scratch / f"{attempt}.rank{rank}.log", "wb") as log:  # the child keeps its fd
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "titan_plugins.testing.upstream_worker",
                            str(scratch / f"rank{rank}.jsonl"),
                            *files,
                        ],
                        cwd=checkout,
                        env=rank_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(
    procs: list[subprocess.Popen[bytes]], records: list[Path], deadline: float, stall_s: float
) -> bool:
    """Wait for every rank. True when all ended; False (the ranks killed) when, once a rank has
    recorded a test, none recorded anything for ``stall_s``, or when ``deadline`` passed.
    Starting (imports, collection: minutes for 8 ranks on a loaded machine) has only the
    deadline."""

    def progress() -> float:
        return max((p.stat().st_mtime for p in records if p.exists()), default=-1.0)

    before = seen = progress()
    last = time.monotonic()
    while any(p.poll() is None for p in procs):
        now, found = time.monotonic(), progress()
        if found != seen:
            seen, last = found, now
        if now > deadline or (seen != before and now - last > stall_s):
            _kill(procs)
            return False
        time.sleep(0.5)
    return True


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the ranks still running and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _read(path: Path) -> tuple[dict[str, Outcome], str, dict[str, Any] | None]:
    """One rank's outcomes (worst phase wins), the test it started last but did not finish, and
    its plugins' states at the end (None when it never got there)."""
    outcomes: dict[str, Outcome] = {}
    running = ""
    states: dict[str, Any] | None = None
    if not path.is_file():
        return outcomes, running, states
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if "started" in record:
            running = record["started"]
            continue
        if "finished" in record:
            running = "" if record["finished"] == running else running
            continue
        if "titan" in record:
            states = record["titan"]
            continue
        if MEGATRON in record:
            continue  # read by _megatron_of
        found = Outcome(record["outcome"], record.get("why", ""))
        known = outcomes.get(record["id"])
        if known is None or _RANK[found.status] > _RANK[known.status]:
            outcomes[record["id"]] = found
    return outcomes, running, states


def _megatron_of(path: Path) -> set[str]:
    """The Megatron one rank's record names (its ``megatron`` lines; none before it started)."""
    if not path.is_file():
        return set()
    found = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if MEGATRON in record:
                found.add(record[MEGATRON])
    return found


def _states(per_rank: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each plugin's state on the first rank that reported, its patches applied or failed on
    any rank."""
    out: dict[str, dict[str, Any]] = {}
    for states in per_rank:
        for name, found in states.items():
            into = out.setdefault(name, {"state": found["state"], "applied": [], "failed": []})
            for key in ("applied", "failed"):
                into[key] = sorted({*into[key], *found[key]})
    return out


def merge(per_rank: list[dict[str, Outcome]]) -> dict[str, Outcome]:
    """A test's outcome over the ranks: failed on any rank fails it (named by rank), skipped on
    any skips it; a test some ranks never reached is missing there, which fails it."""
    merged: dict[str, Outcome] = {}
    ids = {test for outcomes in per_rank for test in outcomes}
    for test in sorted(ids):
        worst: Outcome | None = None
        for rank, outcomes in enumerate(per_rank):
            found = outcomes.get(test) or Outcome(FAILED, "never reached on this rank")
            if len(per_rank) > 1 and found.status != PASSED:
                found = Outcome(found.status, f"rank {rank}: {found.why}")
            if worst is None or _RANK[found.status] > _RANK[worst.status]:
                worst = found
        assert worst is not None
        merged[test] = worst
    return merged


def _problem(
    procs: list[subprocess.Popen[bytes]], ended: bool, running: list[str], logs: Path
) -> tuple[str, str]:
    """A job given up or crashed, named with the test each rank was in, and the first such
    rank's log tail (``<logs>.rank<N>.log``); ("", "") for a job whose ranks all ended with
    pytest's own statuses (tests failing or not)."""
    crashed = [r for r, p in enumerate(procs) if ended and p.returncode not in PYTEST_ENDED]
    if ended and not crashed:
        return "", ""
    where = "; ".join(f"rank {r} in {test}" for r, test in enumerate(running) if test)
    rank = crashed[0] if crashed else 0
    log = logs.parent / f"{logs.name}.rank{rank}.log"
    # less the native libraries' start-up chatter, as verify prints its workers' output
    text = native_noise.without_noise(log.read_text(errors="replace")) if log.exists() else ""
    tail = text[-LOG_TAIL_CHARS:]
    what = (
        f"rank(s) {crashed} exited abnormally"
        if ended
        else "given up: past the timeout, or hung outside any test"
    )
    return f"{what}{f' ({where})' if where else ''}", tail


# ---------------------------------------------------------------------------- judging
def judge(
    name: str, the_plan: Plan, runs: dict[tuple[int, str], Launch], not_run: set[int]
) -> PluginTests:
    """One plugin's counts over its (file, world size) pairs, from the off and on jobs."""
    out = PluginTests(
        name,
        not_judged=list(the_plan.not_judged.get(name, [])),
        declared_none=name in the_plan.declared_none,
    )
    states_checked: set[int] = set()
    for path, size in the_plan.judged_on.get(name, []):
        if size in not_run:
            out.not_judged.append(
                {"test": f"{path} [{size} ranks]", "why": "not run: the time budget ran out"}
            )
            continue
        off, on = runs[(size, OFF)], runs[(size, ON)]
        if size not in states_checked:  # one pair of jobs per world size: named once
            states_checked.add(size)
            _check_states(out, size, off, on)
        ids = sorted({t for t in [*off.outcomes, *on.outcomes] if _in_file(t, path)})
        for test in ids:
            _count(out, f"{test} [{size} ranks]", off.outcomes.get(test), on.outcomes.get(test))
        if not ids:
            out.not_judged.append(
                {"test": f"{path} [{size} ranks]", "why": off.problem or "no test collected"}
            )
    return out


def _check_states(out: PluginTests, size: int, off: Launch, on: Launch) -> None:
    """The on job must have had the plugin enabled with no patch failed, the off job no plugin
    at all: else the comparison says nothing."""
    key = f"upstream run [{size} ranks]"
    state = on.plugins.get(out.name)
    if on.states_seen and (state is None or state["state"] != ENABLED):
        found = state["state"] if state else "not loaded"
        out.regressions.append(f"{key}: the plugin was not enabled with the plugins on ({found})")
    elif state and state["failed"]:
        out.regressions.append(f"{key}: patches failed: {', '.join(state['failed'])}")
    if off.plugins:
        out.regressions.append(
            f"{key}: plugins were active in the run with every plugin off: "
            f"{', '.join(sorted(off.plugins))}"
        )


def _in_file(test: str, path: str) -> bool:
    return test == path or test.startswith(f"{path}::")


def _count(out: PluginTests, key: str, off: Outcome | None, on: Outcome | None) -> None:
    """Adds one test to the counts; ``None``: the mode's run never reached it."""
    off = off or Outcome(MISSING, "never reached: the run with the plugins off hung or crashed")
    on = on or Outcome(MISSING, "never reached: the run with the plugins on hung or crashed")
    out.selected += 1
    out.ran_off += off.status in (PASSED, FAILED)
    out.ran_on += on.status in (PASSED, FAILED)
    out.passed_off += off.status == PASSED
    out.passed_on += on.status == PASSED
    out.passed_both += off.status == PASSED and on.status == PASSED
    if off.status == PASSED and on.status in (FAILED, MISSING):
        out.regressions.append(f"{key}: {on.why}")
    elif off.status == SKIPPED and on.status in (FAILED, MISSING):
        if TOO_FEW_RANKS.search(on.why):  # a case written for more ranks than this job has
            out.not_judged.append(
                {"test": key, "why": f"runs only with the plugins on, needs more ranks: {on.why}"}
            )
        else:  # a path only a plugin's backend opens (e.g. the DeepEP dispatcher): it must work
            out.regressions.append(f"{key}: runs only with the plugins on, and fails: {on.why}")
    elif off.status != PASSED or on.status != PASSED:
        out.not_judged.append({"test": key, "why": _unjudged(off, on)})


def _unjudged(off: Outcome, on: Outcome) -> str:
    """Why a test that is no regression does not count as passing in both modes."""
    if off.status in (FAILED, MISSING):
        return f"fails with the plugins off too: {off.why}"
    if off.status == SKIPPED and on.status == SKIPPED:
        return f"skipped: {off.why}" + ("" if on.why == off.why else f" (on: {on.why})")
    if off.status == SKIPPED:
        return f"skipped with the plugins off ({off.why}); passes with them on"
    return f"passes with the plugins off, skipped with them on: {on.why}"


def run(
    packages: dict[str, str],
    checkout: Path,
    world_sizes: Iterable[int] | None = None,
    timeout_s: float = 1800.0,
    budget_s: float | None = None,
) -> UpstreamResult:
    """Run the selected upstream tests of ``packages`` (name -> package) in ``checkout``, off
    then on, per world size; start no job after ``budget_s``.

    :raises ValueError: a plugin's data file with a bad field.
    """
    missing = [name for name in TEST_REQUIREMENTS if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"running Megatron-LM's unit tests needs {', '.join(missing)} in this environment: "
            "pip install 'titan-plugins[verify]'"
        )
    if not (checkout / "tests" / "unit_tests").is_dir():
        raise ValueError(f"{checkout}: no tests/unit_tests/ (a Megatron-LM checkout has them)")
    # once, in seconds: else every rank of every job fails on the first one missing, and the
    # run ends INCOMPLETE minutes later without naming them
    needs = list(conftest_needs.missing(checkout))
    if needs:
        raise ValueError(
            f"{checkout / conftest_needs.CONFTEST} imports {', '.join(needs)}, not importable "
            f"here: pip install 'titan-plugins[verify]' (or {conftest_needs.pip_command(needs)})"
        )
    started = time.monotonic()
    the_plan = plan(packages, checkout, world_sizes, through_core(packages))
    modes = {
        OFF: {"TITAN_PLUGINS": "0"},
        # whatever this shell's switches say, exactly the selected plugins, as a user's job
        # applies them (the torch.backends entry point at ``import torch``)
        ON: {
            "TITAN_PLUGINS": "1",
            "TITAN_PLUGINS_AUTOLOAD": "1",
            "TITAN_PLUGINS_ONLY": ",".join(packages.keys()),
            "TITAN_PLUGINS_DISABLE": "",
        },
    }
    runs: dict[tuple[int, str], Launch] = {}
    not_run: set[int] = set()
    for size, files in the_plan.launches.items():
        if budget_s is not None and time.monotonic() - started > budget_s:
            not_run.add(size)
            continue
        for mode, env in modes.items():
            job = runs[(size, mode)] = launch(checkout, files, size, mode, env, timeout_s)
            retry_hung(checkout, job, env, timeout_s)
    plugins = {name: judge(name, the_plan, runs, not_run) for name in packages}
    return UpstreamResult(
        plugins,
        list(runs.values()),
        [f"{size} ranks: {', '.join(the_plan.launches[size])}" for size in sorted(not_run)],
        time.monotonic() - started,
    )
