"""``titan-plugins verify``'s upstream-test runner: how it plans, merges ranks and judges (on
synthetic outcomes), and, on a fixture checkout of upstream-style test files run as it runs a
Megatron-LM checkout's, that it names the tests a deliberately broken plugin fails and passes a
plugin that changes no number."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import megatron.core
import pytest

from titan_plugins.testing.fakes import write_dist_info
from titan_plugins.verify import cli, upstream
from titan_plugins.verify.upstream import (
    FAILED,
    OFF,
    ON,
    PASSED,
    SKIPPED,
    Launch,
    Outcome,
    Plan,
    judge,
    merge,
)

FIXTURES = Path(__file__).parent / "verify_fixtures"
CHECKOUT = FIXTURES / "upstream_checkout"
LAYERS = "tests/unit_tests/test_fixture_layers.py"
ROUTER = "tests/unit_tests/test_fixture_router.py"
# The stall rule for the fixture's jobs: each hang costs this long, 3 hangs per leg (15 s made the
# two hang tests 88 s of every full leg; 8 s: 64 s quiet, 77 s with two busy loops beside them on
# 2 cores, both passing). Only the fixture's tiny tests between two records are under this bound:
# imports and collection, which take far longer under load, have only the deadline (upstream._wait).
FIXTURE_STALL_S = 8
VALUE_TEST = (
    f"{LAYERS}::TestColumnParallelLinear::test_output_is_the_input_times_the_gathered_weight"
)
ROUTER_TEST = f"{ROUTER}::TestTopKRouter::test_gating_is_the_linear_map_of_the_input"
SELECTION = {
    "megatron_lm_tests": {
        LAYERS: {"covers": ["x.linear"], "world_sizes": [1, 2]},
        ROUTER: {"covers": ["x.router"]},
    },
    "not_covered": {},
}


# ---------------------------------------------------------------------------- merging and judging
def test_a_test_fails_when_any_rank_fails_it_or_never_reaches_it() -> None:
    ranks = [
        {"a": Outcome(PASSED), "b": Outcome(PASSED), "c": Outcome(SKIPPED, "needs TE")},
        {"a": Outcome(PASSED), "b": Outcome(FAILED, "E boom"), "c": Outcome(SKIPPED, "needs TE")},
        {"a": Outcome(PASSED), "c": Outcome(SKIPPED, "needs TE")},
    ]
    merged = merge(ranks)
    assert merged["a"] == Outcome(PASSED)
    assert merged["b"] == Outcome(FAILED, "rank 1: E boom")
    assert merged["c"] == Outcome(SKIPPED, "rank 0: needs TE")
    assert merge([{"a": Outcome(PASSED)}, {}])["a"] == Outcome(
        FAILED, "rank 1: never reached on this rank"
    )


def _job(size: int, mode: str, outcomes: dict[str, Outcome], plugins: dict | None = None) -> Launch:
    enabled = {"p": {"state": "enabled", "applied": ["p.x"], "failed": []}}
    job = Launch(size, mode, [LAYERS], outcomes)
    job.plugins = {} if mode == OFF else enabled if plugins is None else plugins
    job.states_seen = True
    return job


def test_judge_counts_each_mode_and_names_regressions_and_what_it_cannot_judge() -> None:
    t = f"{LAYERS}::t"
    off = {
        f"{t}1": Outcome(PASSED),
        f"{t}2": Outcome(PASSED),
        f"{t}3": Outcome(SKIPPED, "needs TE"),
        f"{t}4": Outcome(FAILED, "cpu != cuda"),
        f"{t}5": Outcome(SKIPPED, "needs DeepEP"),
        f"{t}6": Outcome(PASSED),
        f"{t}7": Outcome(SKIPPED, "needs DeepEP"),
        f"{t}8": Outcome(SKIPPED, "needs DeepEP"),
    }
    on = {
        f"{t}1": Outcome(PASSED),
        f"{t}2": Outcome(FAILED, "values differ"),
        f"{t}3": Outcome(SKIPPED, "needs TE"),
        f"{t}4": Outcome(FAILED, "cpu != cuda"),
        f"{t}5": Outcome(FAILED, "dispatch broke"),
        # t6: never reached with the plugins on (the job hung)
        f"{t}7": Outcome(PASSED),
        f"{t}8": Outcome(FAILED, "RuntimeError: world_size (1) is not divisible by 8"),
        "other.py::t": Outcome(FAILED, "not this plugin's file"),
    }
    plan = Plan({1: [LAYERS]}, {"p": [(LAYERS, 1)]}, {"p": [{"test": ROUTER, "why": "absent"}]})
    found = judge("p", plan, {(1, OFF): _job(1, OFF, off), (1, ON): _job(1, ON, on)}, set())
    assert (found.selected, found.ran_off, found.passed_off) == (8, 4, 3)
    assert (found.ran_on, found.passed_on, found.passed_both) == (6, 2, 1)
    assert found.regressions == [
        f"{t}2 [1 ranks]: values differ",
        f"{t}5 [1 ranks]: runs only with the plugins on, and fails: dispatch broke",
        f"{t}6 [1 ranks]: never reached: the run with the plugins on hung or crashed",
    ]
    assert found.not_judged == [
        {"test": ROUTER, "why": "absent"},
        {"test": f"{t}3 [1 ranks]", "why": "skipped: needs TE"},
        {"test": f"{t}4 [1 ranks]", "why": "fails with the plugins off too: cpu != cuda"},
        {
            "test": f"{t}7 [1 ranks]",
            "why": "skipped with the plugins off (needs DeepEP); passes with them on",
        },
        {
            # megatron's refusal of a case written for more ranks is no plugin's failure
            "test": f"{t}8 [1 ranks]",
            "why": "runs only with the plugins on, needs more ranks: "
            "RuntimeError: world_size (1) is not divisible by 8",
        },
    ]
    assert found.verdict == "FAIL"


def test_nothing_judged_is_never_a_pass_and_leaves_the_run_incomplete() -> None:
    plan = Plan({1: [LAYERS]}, {"p": [(LAYERS, 1)]}, {})
    crashed = {}  # the checkout's conftest did not import: no rank reached a test
    jobs = {(1, OFF): _job(1, OFF, crashed), (1, ON): _job(1, ON, crashed)}
    jobs[(1, OFF)].problem = "rank(s) [0] exited abnormally"
    found = judge("p", plan, jobs, set())
    assert found.regressions == [] and found.verdict == "NOT JUDGED"
    assert found.not_judged == [
        {"test": f"{LAYERS} [1 ranks]", "why": "rank(s) [0] exited abnormally"}
    ]
    skipped = {f"{LAYERS}::t": Outcome(SKIPPED, "needs TE")}  # every test skipped: the same
    jobs = {(1, OFF): _job(1, OFF, skipped), (1, ON): _job(1, ON, skipped)}
    assert judge("p", plan, jobs, set()).verdict == "NOT JUDGED"
    # a plugin whose data file selects no upstream file (and says why) is not judged either,
    # but expected so: it does not leave the run incomplete
    declared = Plan({}, {}, {"q": [{"test": upstream.SUITE, "why": "no upstream test file"}]})
    declared.declared_none.add("q")
    none = judge("q", declared, {}, set())
    assert none.verdict == "NOT JUDGED" and none.declared_none

    differential = SimpleNamespace(verdict="PASS")
    tests = SimpleNamespace(plugins={"p": found, "q": none}, not_run=[])
    assert cli.verdict(differential, tests) == "INCOMPLETE"
    tests.plugins = {"q": none}
    assert cli.verdict(differential, tests) == "PASS"


def test_a_plugin_not_enabled_or_with_failed_patches_in_the_on_job_is_a_regression() -> None:
    plan = Plan({1: [LAYERS]}, {"p": [(LAYERS, 1)]}, {})
    same = {f"{LAYERS}::t": Outcome(PASSED)}

    def judged(plugins: dict) -> list[str]:
        jobs = {(1, OFF): _job(1, OFF, same), (1, ON): _job(1, ON, same, plugins)}
        return judge("p", plan, jobs, set()).regressions

    assert judged({}) == [
        "upstream run [1 ranks]: the plugin was not enabled with the plugins on (not loaded)"
    ]
    assert judged({"p": {"state": "disabled", "applied": [], "failed": []}}) == [
        "upstream run [1 ranks]: the plugin was not enabled with the plugins on (disabled)"
    ]
    assert judged({"p": {"state": "enabled", "applied": [], "failed": ["p.x"]}}) == [
        "upstream run [1 ranks]: patches failed: p.x"
    ]
    assert judge("p", plan, {}, {1}).not_judged == [
        {"test": f"{LAYERS} [1 ranks]", "why": "not run: the time budget ran out"}
    ]


def _package(root: Path, name: str, module: str, selection: dict) -> None:
    """A plugin package on ``root`` (its hooks from a fixture module) with a data file."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(f"from {module} import *  # noqa: F403\n")
    (root / name / "upstream_tests.json").write_text(json.dumps(selection))


def test_plan_runs_each_file_at_its_world_sizes_and_says_what_it_leaves_out(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.syspath_prepend(str(tmp_path))
    gone = "tests/unit_tests/test_gone.py"
    selection = {**SELECTION, "megatron_lm_tests": {**SELECTION["megatron_lm_tests"], gone: {"covers": ["x"]}}}  # fmt: skip
    _package(tmp_path, "titan_verify_plan_a", "titan_verify_idle", selection)
    packages = {"a": "titan_verify_plan_a", "b": "json"}  # json ships no data file
    plan = upstream.plan(packages, CHECKOUT)
    assert plan.launches == {1: [LAYERS, ROUTER], 2: [LAYERS]}
    assert plan.judged_on["a"] == [(LAYERS, 1), (LAYERS, 2), (ROUTER, 1)]
    assert plan.not_judged["a"] == [{"test": gone, "why": "not in this checkout"}]
    assert plan.not_judged["b"] == [
        {"test": "megatron_lm_tests", "why": "json ships no upstream_tests.json"}
    ]
    only_two = upstream.plan(packages, CHECKOUT, [2])
    assert only_two.launches == {2: [LAYERS]}
    assert {"test": ROUTER, "why": "written for 1 ranks; --world-sizes gave 2"} in (
        only_two.not_judged["a"]
    )


@pytest.mark.parametrize("text", ["0", "two", "1,-2"])
def test_world_sizes_that_are_not_numbers_of_ranks_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a number of ranks"):
        cli.world_sizes(text)


def test_a_missing_test_requirement_is_refused_with_the_extra_to_install(monkeypatch) -> None:
    monkeypatch.setattr(upstream, "TEST_REQUIREMENTS", ("pytest", "titan_no_such_module"))
    with pytest.raises(ValueError, match=r"needs titan_no_such_module .*titan-plugins\[verify\]"):
        upstream.run({}, CHECKOUT)
    monkeypatch.undo()
    assert all(__import__(name) for name in upstream.TEST_REQUIREMENTS)  # the venv has them


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="Transformer Engine is installed: megatron reads its real version",
)
def test_without_transformer_engine_megatron_reads_version_zero(monkeypatch) -> None:
    from megatron.core import utils

    from titan_plugins.testing import upstream_worker

    monkeypatch.setattr(utils, "_te_version", None)  # as after import, before any TE gate
    upstream_worker.no_te_reads_as_version_zero()
    # megatron-core 0.16's get_te_version() answered None here, and this raised TypeError
    assert utils.is_te_min_version("1.3") is False


# ---------------------------------------------------------------------------- running
def _install(root: Path) -> None:
    """The two broken fixture plugins, as packages with data files selecting the fixture
    checkout's tests, discoverable by entry point from ``root``."""
    _package(root, "titan_verify_perturb_up", "titan_verify_perturb", SELECTION)
    _package(root, "titan_verify_idle_up", "titan_verify_idle", SELECTION)
    write_dist_info(
        root,
        "titan-verify-upstream-fixtures",
        {"verify_perturb": "titan_verify_perturb_up", "verify_idle": "titan_verify_idle_up"},
    )


@pytest.fixture
def fixture_plugins(tmp_path, monkeypatch) -> Path:
    """The fixture plugins on this process's path and on its workers' (``PYTHONPATH``)."""
    site = tmp_path / "site"
    site.mkdir()
    _install(site)
    path = [str(site), str(FIXTURES)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]))
    for entry in reversed(path):
        monkeypatch.syspath_prepend(entry)
    return site


@pytest.mark.multiprocess
def test_upstream_tests_name_what_a_plugin_that_changes_the_numbers_breaks(
    fixture_plugins,
) -> None:
    result = upstream.run(
        {"verify_perturb": "titan_verify_perturb_up", "verify_idle": "titan_verify_idle_up"},
        CHECKOUT,
    )
    perturb, idle = result.plugins["verify_perturb"], result.plugins["verify_idle"]
    # both plugins were on together in the on jobs: each is judged on its own files (the same
    # here), so both see the perturbed numbers; the runs below separate them
    assert [j.as_dict()["plugins"]["verify_perturb"]["state"] for j in result.launches if j.mode == ON] == ["enabled", "enabled"]  # fmt: skip
    assert perturb.regressions == idle.regressions
    assert perturb.regressions == [
        f"{VALUE_TEST} [1 ranks]: AssertionError: Tensor-likes are not close!",
        f"{VALUE_TEST} [2 ranks]: rank 0: AssertionError: Tensor-likes are not close!",
        f"{ROUTER_TEST} [1 ranks]: AssertionError: Tensor-likes are not close!",
    ]
    # 3 layer tests judged at 1 and 2 ranks, the router test at 1; a skip and a test the CPU
    # harness cannot serve at each size are not judged
    assert (perturb.selected, perturb.ran_off, perturb.passed_off, perturb.passed_on) == (
        11,
        9,
        7,
        4,
    )
    assert sorted(j["why"] for j in perturb.not_judged) == [
        "fails with the plugins off too: AssertionError: assert 'cpu' == 'cuda'",
        "fails with the plugins off too: rank 0: AssertionError: assert 'cpu' == 'cuda'",
        "skipped: Skipped: needs Transformer Engine",
        "skipped: rank 0: Skipped: needs Transformer Engine",
    ]


@pytest.mark.multiprocess
def test_a_test_that_hangs_fails_as_hung_and_the_job_goes_on_without_it(monkeypatch) -> None:
    monkeypatch.setenv("TITAN_VERIFY_FIXTURE_HANG", "1")
    job = upstream.launch(
        CHECKOUT,
        [LAYERS, ROUTER],
        1,
        OFF,
        {"TITAN_PLUGINS": "0"},
        timeout_s=900,
        stall_s=FIXTURE_STALL_S,
    )
    hang = f"{LAYERS}::TestColumnParallelLinear::test_a_hang_when_asked"
    assert job.outcomes[hang].status == FAILED
    assert job.outcomes[hang].why.startswith(
        f"hung: no rank recorded anything for {FIXTURE_STALL_S} s"
    )
    # the tests before it, and those after it in the restarted job
    assert job.outcomes[VALUE_TEST] == Outcome(PASSED)
    assert job.outcomes[ROUTER_TEST] == Outcome(PASSED)
    assert job.outcomes[f"{LAYERS}::TestColumnParallelLinear::test_the_tensor_is_on_a_gpu"].status == FAILED  # fmt: skip
    assert job.problem == f"1 test(s) hung and were left out: {hang}"
    # run again alone, it hangs again: it stays failed, and says so
    upstream.retry_hung(
        CHECKOUT, job, {"TITAN_PLUGINS": "0"}, timeout_s=900, stall_s=FIXTURE_STALL_S
    )
    assert job.outcomes[hang].status == FAILED
    assert job.outcomes[hang].why.endswith("the job went on without it; hung again alone")
    assert job.problem.endswith(f"; run again alone: {hang}")


@pytest.mark.multiprocess
def test_a_test_that_hung_only_under_load_is_judged_by_its_run_alone(monkeypatch, tmp_path) -> None:
    # the stall rule cannot tell a hang from a test the load slowed past it (8 ranks on 2 cores)
    monkeypatch.setenv("TITAN_VERIFY_FIXTURE_HANG", str(tmp_path / "hung-once"))
    env = {"TITAN_PLUGINS": "0"}
    job = upstream.launch(CHECKOUT, [LAYERS], 1, OFF, env, timeout_s=900, stall_s=FIXTURE_STALL_S)
    hang = f"{LAYERS}::TestColumnParallelLinear::test_a_hang_when_asked"
    assert job.outcomes[hang].why.startswith(upstream.HUNG)
    upstream.retry_hung(CHECKOUT, job, env, timeout_s=900, stall_s=FIXTURE_STALL_S)
    assert job.outcomes[hang] == Outcome(PASSED, "hung in the full job; run again alone: passed")
    assert job.outcomes[VALUE_TEST] == Outcome(PASSED)  # the others keep their outcomes


HOLDING_TESTS = """
import os
import weakref

import torch.distributed as dist

MADE = {}


def threads():
    return len(os.listdir("/proc/self/task"))


class Model:
    pass


class TestEachBuildsAModelWithItsOwnGroup:
    def setup_method(self, method):
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        MADE.setdefault("threads_before", threads())
        self.model = Model()
        self.model.group = dist.new_group([0])  # as megatron's layers hold their groups
        MADE.setdefault("model", weakref.ref(self.model))

    def test_first(self):
        MADE["threads_in_first"] = threads()
        assert MADE["threads_in_first"] > MADE["threads_before"]  # a gloo group's own threads

    def test_second_finds_the_first_let_go(self):
        assert MADE["model"]() is None
        assert threads() == MADE["threads_in_first"]  # not the first group's threads on top
"""


def launch_one_file(folder: Path, name: str, text: str, ranks: int) -> tuple[str, Launch]:
    """One upstream-style test file written into a scratch checkout, run in one job of
    ``ranks`` workers with the plugins off: its path and the launch."""
    tests = folder / "tests" / "unit_tests"
    tests.mkdir(parents=True)
    (tests / name).write_text(text)
    path = f"tests/unit_tests/{name}"
    return path, upstream.launch(folder, [path], ranks, OFF, {"TITAN_PLUGINS": "0"}, timeout_s=600)


@pytest.mark.multiprocess
def test_a_finished_test_s_instance_and_process_groups_are_let_go(tmp_path) -> None:
    # pytest keeps each test's class instance to the end of the session, and with it what
    # setup_method stored: at 8 ranks the destroyed gloo groups' threads piled up to 1,000 per
    # rank. The worker drops the instance after each test and destroys the groups left.
    path, job = launch_one_file(tmp_path, "test_holding.py", HOLDING_TESTS, ranks=1)
    assert job.outcomes == {
        f"{path}::TestEachBuildsAModelWithItsOwnGroup::test_first": Outcome(PASSED),
        f"{path}::TestEachBuildsAModelWithItsOwnGroup::test_second_finds_the_first_let_go": Outcome(PASSED),
    }  # fmt: skip


OWN_PAIR_TESTS = """
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def test_each_rank_makes_the_group_of_its_own_pair():
    # as test_schedules.py's _populate_embedding_and_position_groups does: ranks 0, 2 make
    # new_group([0, 2]) while ranks 1, 3 make new_group([1, 3]), at the same count
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = [rank % 2, rank % 2 + 2]
    pair = dist.new_group(ranks=mine)
    everyone = dist.new_group(ranks=[0, 1, 2, 3])
    assert c10d._get_process_group_name(pair).endswith(":" + "-".join(map(str, mine)))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=pair)
    assert total.item() == sum(mine)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=everyone)
    assert total.item() == 6
"""


@pytest.mark.multiprocess
def test_groups_of_different_ranks_made_at_the_same_count_meet_apart(tmp_path) -> None:
    # gloo connects a group when it is made, under a store prefix that is its name; torch names
    # it by a count alone, so two pairs made at once on different ranks met under one name
    # (test_schedules.py's two *_with_custom_pgs cases hung in 1 to 2 of 3 runs at 8 ranks)
    path, job = launch_one_file(tmp_path, "test_own_pair.py", OWN_PAIR_TESTS, ranks=4)
    assert job.outcomes == {
        f"{path}::test_each_rank_makes_the_group_of_its_own_pair": Outcome(PASSED)
    }


@pytest.mark.multiprocess
def test_upstream_tests_pass_a_plugin_that_changes_no_number(fixture_plugins) -> None:
    result = upstream.run({"verify_idle": "titan_verify_idle_up"}, CHECKOUT)
    idle = result.plugins["verify_idle"]
    assert idle.regressions == [] and idle.verdict == "PASS"
    assert (idle.selected, idle.ran_off, idle.passed_off, idle.ran_on, idle.passed_on) == (
        11,
        9,
        7,
        9,
        7,
    )


@pytest.mark.multiprocess
def test_verify_with_a_checkout_exits_1_and_names_the_broken_tests(
    fixture_plugins, tmp_path
) -> None:
    # a checkout: the fixture tests next to the installed megatron (as a checkout holds its own)
    checkout = tmp_path / "Megatron-LM"
    shutil.copytree(CHECKOUT, checkout)
    (checkout / "megatron").symlink_to(Path(megatron.core.__file__).parent.parent)
    report = tmp_path / "verify.json"
    done = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli", "verify", "--megatron-lm", str(checkout),
         "--only", "verify_perturb", "--layouts", "pp2xep2", "--world-sizes", "1",
         "--json", str(report)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-3000:]
    assert f"regression: {VALUE_TEST} [1 ranks]" in done.stdout
    found = json.loads(report.read_text())
    mine = found["plugins"]["verify_perturb"]
    assert (mine["selected"], mine["passed_off"], mine["passed_on"]) == (6, 4, 2)
    assert mine["regressions"][:2] == [
        f"{VALUE_TEST} [1 ranks]: AssertionError: Tensor-likes are not close!",
        f"{ROUTER_TEST} [1 ranks]: AssertionError: Tensor-likes are not close!",
    ]
    assert any(r.startswith("differential: pp2xep2: losses differ") for r in mine["regressions"])
    assert found["verdict"] == "FAIL"
    assert [job["world_size"] for job in found["upstream"]["launches"]] == [1, 1]


def test_a_plugin_acting_through_the_core_step_hooks_is_judged_on_the_core_files(
    tmp_path,
) -> None:
    # rewind registers no patch of its own: its work runs inside the core's training-step
    # wrappers, whose patches the core's data file selects files for
    users = upstream.through_core(["rewind", "weight_sync"])
    assert users == {"rewind"}
    core = list(upstream.selection.load(upstream.suite_host().__name__).tests)
    reads = list(upstream.selection.load("titan_weight_sync").tests)
    assert reads and all(t.reads and not t.covers and t.world_sizes for t in reads)
    for test in core + reads:
        (tmp_path / test.path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / test.path).write_text("")
    packages = {"rewind": "titan_rewind", "weight_sync": "titan_weight_sync"}
    plan = upstream.plan(packages, tmp_path, None, users)
    assert plan.judged_on["rewind"] == [(t.path, n) for t in core for n in t.world_sizes or (1,)]
    # weight_sync patches nothing of Megatron and has no step hook: it is judged on the files
    # that test what its trainer side reads, not on the core's
    assert plan.judged_on["weight_sync"] == [(t.path, n) for t in reads for n in t.world_sizes]
    assert plan.not_judged["weight_sync"] == [] and "weight_sync" not in plan.declared_none
