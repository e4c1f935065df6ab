"""One rank of a run of a Megatron-LM checkout's own unit tests on CPU (``titan-plugins verify``).

TEST-TIME ONLY. Started by :mod:`titan_plugins.verify.upstream`, once per rank, in the checkout's
folder, with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set
as ``torchrun`` sets them (the tests' ``Utils`` reads them)::

    python -m titan_plugins.testing.upstream_worker RECORD_FILE TEST_FILE...

No upstream file is edited. Before pytest collects, the worker makes this CPU process look like
a one-GPU rank, the way the tests expect one:

- the core's CPU harness (``cpu_harness.install()``): CUDA streams, events, RNG and
  ``device="cuda"`` land on the CPU;
- ``torch.cuda.is_available()`` answers True and ``device_count()`` 1: most upstream tests skip
  themselves without a GPU (``skipif(not torch.cuda.is_available())``), and ``Utils`` picks its
  device as ``rank % device_count()``. The harness leaves ``is_available`` alone because
  ``torch._dynamo`` then queries device properties; these workers run with
  ``TORCH_COMPILE_DISABLE=1``;
- ``init_process_group(backend="nccl")`` gets gloo;
- without Transformer Engine, ``get_te_version()`` answers 0.0.0 as megatron 0.17+ does (0.16's
  None breaks the core_v0.16.1 conftest's setup of every test).

Plugins reach the worker the way they reach a user's job (the ``torch.backends`` entry point, at
``import torch``), under the switches the parent set (``TITAN_PLUGINS=0`` for the off run).

Each test's outcome on this rank is appended to ``RECORD_FILE`` as one JSON line as soon as it
is known, so a run that hangs or crashes still tells which tests finished and which one was
running (``{"started": id}`` lines).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import pluggy

pytest_hookimpl = pluggy.HookimplMarker("pytest")
"""pytest's own ``hookimpl`` marker, without importing pytest here: the parent (``verify``)
imports this module for its constants, and needs pytest only when it runs the upstream tests."""

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SKIP_ENV = "TITAN_VERIFY_SKIP_FILE"
MEGATRON = "megatron"
"""The record naming the Megatron this rank imported (``megatron-core <version> from <folder>``)."""
WRONG_MEGATRON = 6
"""The exit status of a rank that imported megatron from outside the checkout (no test ran)."""
WHY_CHARS = 300
"""The first error line (or skip reason) is cut here: the report names it, the log has it."""


class Recorder:
    """A pytest plugin: one JSON line per test outcome (and per test started) on this rank."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._tests_done = 0

    def _write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()  # a hung or killed rank still leaves what it finished

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        """Deselects the tests a restarted job has done already (``TITAN_VERIFY_SKIP_FILE``)."""
        path = os.environ.get(SKIP_ENV, "")
        done = set(Path(path).read_text(encoding="utf-8").splitlines()) if path else set()
        if not done:
            return
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in done])
        items[:] = [i for i in items if i.nodeid not in done]

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        """Names the test running, for a run that never returns from it."""
        self._write({"started": nodeid})

    def pytest_runtest_logreport(self, report: Any) -> None:
        """The outcome of a test's call phase, and any setup or teardown that did not pass."""
        if report.when != "call" and report.passed:
            return
        self._write(
            {
                "id": report.nodeid,
                "when": report.when,
                "outcome": _outcome(report),
                "why": _why(report),
            }
        )

    def pytest_collection_finish(self, session: Any) -> None:
        """What exists once the tests are collected (torch, megatron, the test modules) lives to
        the end: it leaves the collector's view, so the collection after each test
        (:func:`forget_test_instance`) walks only what the tests made (a full one over all of
        it tripled the 1-rank job's time)."""
        gc.freeze()

    @pytest_hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Any:
        """After each test and its teardown: what the test built is let go and the process
        groups it left behind are released (all of them after a file's last test), then the test
        is recorded as finished (a job that hangs later does not blame it)."""
        try:
            return (yield)
        finally:
            forget_test_instance(item)
            release_process_groups(force=nextitem is None or nextitem.path != item.path)
            self._tests_done += 1
            agree_on_group_names(self._tests_done)
            self._write({"finished": item.nodeid})

    def pytest_sessionfinish(self, session: Any) -> None:
        """What the plugins did in this rank: state, patches applied and failed (``titan``)."""
        self._write({"titan": plugin_states()})

    def pytest_collectreport(self, report: Any) -> None:
        """A file that does not import (a missing dependency, a moved API): its tests never run."""
        if report.failed:
            self._write(
                {"id": report.nodeid, "when": "collect", "outcome": FAILED, "why": _why(report)}
            )


def forget_test_instance(item: Any) -> None:
    """Drops pytest's hold on a finished test's class instance, and collects it.

    pytest keeps each test's instance (``item._instance``, and the bound method in ``_obj``) to
    the end of the session, and with it whatever ``setup_method`` stored on ``self``: models
    whose layers hold their process groups. A destroyed gloo group keeps its threads until its
    last reference goes, so over a file of tests that each build a model at 8 ranks they piled
    up (measured: 24 more threads per test in ``test_routers.py``, 750 to 1,130 per rank, the
    load past 1,000). Nothing reads them after the test: pytest makes a fresh instance for each.
    """
    for name in ("_instance", "_obj"):
        item.__dict__.pop(name, None)  # (pytest versions without them: nothing to drop)
    gc.collect()  # models and their modules hold each other in cycles


GROUP_NAMES_PER_TEST = 1_000_000
"""How many process-group names each test may use up (torch names a group by a running count)."""


def agree_on_group_names(tests_done: int) -> None:
    """Starts the next test's process-group names where every rank starts them.

    torch names a new group by a count each rank keeps (``_world.group_count``), and a group's
    ranks meet under that name in the store. A test that fails on some ranks part way through
    building its groups leaves the counts apart, and the next test to build groups waits
    forever in ``new_group`` (measured at 8 ranks: ``test_multimodule_schedules.py``'s 8-GPU
    cases fail on CPU, and ``test_shared_experts.py``'s first case then hung in every run; alone
    it passes). Every rank runs the same tests in the same order, so the number of tests done
    is a count they share without a collective; the names go on rising, never reused within a
    job's store.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        c10d._world.group_count = tests_done * GROUP_NAMES_PER_TEST


def name_groups_by_their_ranks() -> None:
    """Names each new process group by its count and its member ranks, not its count alone.

    Some upstream tests have each rank call ``new_group`` with the ranks of its own pipeline
    group (``test_schedules.py``'s ``_populate_embedding_and_position_groups``): on ranks 0 and
    1, ``new_group([0, 6])`` and ``new_group([1, 7])`` both take the name of the same count.
    NCCL builds a group on its first collective, so on GPUs the two never meet; gloo connects
    at once, under a store prefix that is the name, and the two groups' ranks then pair across
    groups or wait on each other (measured at 8 ranks: the two ``*_with_custom_pgs`` pipelining
    cases hung in 1 to 2 of 3 runs, in either mode, with a rank in that ``new_group``). With
    the ranks in the name such groups meet apart; a group every rank makes with the same
    ranks keeps one name on every rank, and the count goes on as torch keeps it.
    """
    from torch.distributed import distributed_c10d as c10d

    by_count = c10d._process_group_name

    def by_count_and_ranks(ranks: list[int], use_hashed_name: bool) -> Any:
        name = by_count(ranks, use_hashed_name)
        if use_hashed_name or not ranks:
            return name  # already by ranks (local synchronization), or the default group
        return type(name)(f"{name}:{'-'.join(map(str, ranks))}")

    c10d._process_group_name = by_count_and_ranks


def release_process_groups(force: bool = False) -> None:
    """Destroys every process group but the default one, once megatron's parallel state is down
    (``force``: after taking it down).

    ``destroy_model_parallel`` drops megatron's groups without destroying them. Each gloo group
    keeps its threads, so over files of tests that each build the groups anew they pile up
    (measured: 7,235 threads in one rank after about 500 tests, and the machine's load near
    900). A test whose teardown takes the parallel state down releases its groups at once; a
    file whose tests leave it up (the next test's setup rebuilds it) releases them after its
    last test. Every rank runs the same tests, so every rank releases alike (destroying a group
    is local).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    state = sys.modules.get("megatron.core.parallel_state")
    if state is not None and state.model_parallel_is_initialized():
        if not force:
            return
        state.destroy_model_parallel()
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)


def plugin_states() -> dict[str, dict[str, Any]]:
    """Per plugin active here: its state, the ids of its patches applied and failed."""
    from titan_plugins import report

    return {
        entry["name"]: {
            "state": entry["state"],
            "applied": [p["id"] for p in entry["patches"] if p["status"] == "applied"],
            "failed": [p["id"] for p in entry["patches"] if p["status"] == "failed"],
        }
        for entry in report.collect()["plugins"]
    }


def _outcome(report: Any) -> str:
    if hasattr(report, "wasxfail"):
        return SKIPPED  # an expected failure (or an unexpected pass) judges nothing
    return PASSED if report.passed else SKIPPED if report.skipped else FAILED


def _why(report: Any) -> str:
    """A skip's reason, or a failure's first ``E`` line (else its last line)."""
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"[:WHY_CHARS]
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[-1])[:WHY_CHARS]
    if report.passed:
        return ""
    lines = [line for line in str(report.longreprtext).splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors[0] if errors else lines[-1] if lines else "failed")[:WHY_CHARS]


def look_like_one_gpu() -> None:
    """The CPU harness, plus what the upstream tests' own gates and ``Utils`` ask of a GPU."""
    import torch

    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    init_process_group = torch.distributed.init_process_group

    def gloo_for_nccl(*args: Any, **kwargs: Any) -> Any:
        if args[:1] and "nccl" in str(args[0]):
            args = ("gloo", *args[1:])
        if "nccl" in str(kwargs.get("backend") or ""):
            kwargs["backend"] = "gloo"
        return init_process_group(*args, **kwargs)

    torch.distributed.init_process_group = gloo_for_nccl
    name_groups_by_their_ranks()
    no_te_reads_as_version_zero()


def no_te_reads_as_version_zero() -> None:
    """Without Transformer Engine, megatron's ``get_te_version()`` answers 0.0.0, as megatron-core
    0.17 and later do. 0.16's answers None, and the core_v0.16.1 checkout's ``conftest.py``
    (its autouse ``set_env`` asks ``is_te_min_version("1.3")``) then errors in the setup of
    every test. With 0.0.0 each TE gate answers False, and the tests that need TE skip. (An
    importable TE gives its version, never None: nothing to do then.)"""
    from megatron.core import utils
    from packaging.version import Version

    if utils.get_te_version() is None:
        utils._te_version = Version("0.0.0")


def main(argv: list[str]) -> int:
    """Run pytest over the test files in this process; pytest's exit status."""
    record, files = argv[0], argv[1:]
    checkout = os.getcwd()
    sys.path.insert(
        0, checkout
    )  # the tests import ``tests.unit_tests...`` and the checkout's megatron
    look_like_one_gpu()
    import pytest

    from titan_plugins.testing.training_runs import imported_megatron

    # a Megatron-LM checkout's tests judge its own megatron, never the installed one; a folder
    # of test files without one (the project's fixture checkout) runs the installed one
    own = (Path(checkout) / "megatron" / "core" / "package_info.py").is_file()
    try:
        seen = imported_megatron(checkout if own else None)
    except RuntimeError as err:
        print(f"titan-plugins verify: {err}", file=sys.stderr)
        return WRONG_MEGATRON
    with open(record, "a", encoding="utf-8") as out:
        out.write(json.dumps({MEGATRON: seen}) + "\n")
        return int(
            pytest.main(
                [
                    *files,
                    "-q",
                    "--continue-on-collection-errors",  # one file that does not import is named
                    "-p",
                    "no:cacheprovider",  # nothing written into the user's checkout
                    "-o",
                    "addopts=",
                    "--rootdir",
                    checkout,
                ],
                plugins=[Recorder(out)],
            )
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
