"""``titan-plugins verify``'s differential training check: how it judges (on synthetic runs),
that it names deliberately broken plugins (one perturbs the numbers, one applies and does
nothing), and that every plugin this project ships passes it on the installed Megatron, run as a
user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.manager import FIRST_PARTY
from titan_plugins.testing.fakes import write_dist_info
from titan_plugins.verify import differential, selection
from titan_plugins.verify.differential import ALL, OFF, judge

FIXTURES = Path(__file__).parent / "verify_fixtures"


def _rank(runs: dict[str, tuple[list[float], list[float], dict]]) -> dict:
    return {
        name: {"losses": losses, "norms": norms, "effects": effects, "failed": []}
        for name, (losses, norms, effects) in runs.items()
    }


def test_judge_holds_a_plugin_to_bit_identity_unless_it_states_a_bound() -> None:
    ranks = [
        _rank(
            {
                OFF: ([2.0, 1.5], [1.0, 0.8], {}),
                "+exact": ([2.0, 1.5], [1.0, 0.8], {"exact": {"bytes": 10.0}}),
                "+close": ([2.0, 1.5000001], [1.0, 0.8], {"close": {"gemms": 3.0}}),
                "+fp8": ([2.01, 1.51], [1.0, 0.81], {"fp8": {"gemms": 3.0}}),
            }
        )
    ]
    specs = {
        "exact": selection.Differential(),
        "close": selection.Differential(),
        "fp8": selection.Differential(loss_bound=0.015, norm_bound=0.03),
    }
    verdicts, _, problems = judge({"pp2xep2": ranks}, ["close", "exact", "fp8"], specs)
    assert verdicts["exact"].passed and verdicts["fp8"].passed and not problems
    assert not verdicts["close"].passed  # 7e-8 relative is not bit-identical
    assert "must be bit-identical" in verdicts["close"].problems[0]
    ranks[0]["+fp8"]["losses"] = [2.1, 1.5]  # 5% off: beyond its stated 1.5%
    verdicts, _, _ = judge({"pp2xep2": ranks}, ["fp8"], specs)
    assert "the stated bound is 0.015" in verdicts["fp8"].problems[0]


def test_judge_names_a_plugin_that_did_nothing_and_spares_one_that_acts_outside_the_step() -> None:
    ranks = [_rank({OFF: ([2.0], [1.0], {}), "+idle": ([2.0], [1.0], {"idle": {"n": 0.0}})})]
    ranks[0]["+rl"] = ranks[0]["+idle"]
    specs = {
        "idle": selection.Differential(),
        "rl": selection.Differential(outside_the_step="syncs weights between steps"),
    }
    verdicts, _, _ = judge({"pp2xep2": ranks}, ["idle", "rl"], specs)
    assert verdicts["idle"].problems == ["pp2xep2: applied and did nothing: no work counted in "
                                         "the run (titan_effects unchanged)"]  # fmt: skip
    assert verdicts["rl"].passed


def test_judge_reports_layouts_it_cannot_judge_and_failed_runs_and_patches() -> None:
    ranks = [
        _rank(
            {
                OFF: ([2.0], [1.0], {}),
                "+a": ([2.0], [1.0], {"a": {"n": 1.0}}),
                ALL: ([2.0], [1.0], {"a": {"n": 1.0}, "b": {"n": 1.0}}),
            }
        )
    ]
    ranks[0][ALL]["failed"] = ["b.patch"]
    specs = {
        "a": selection.Differential(),
        "b": selection.Differential(not_in_layouts={"pp2xvpp2": "needs EP > 1"}),
    }
    verdicts, all_on, problems = judge({"pp2xep2": ranks}, ["a", "b"], specs)
    assert verdicts["a"].passed
    assert verdicts["b"].problems == ["pp2xep2: training with it alone failed"]
    assert problems == ["pp2xep2, all plugins on: patches failed: b.patch"]
    verdicts, _, _ = judge({"pp2xvpp2": [_rank({OFF: ([2.0], [1.0], {})})]}, ["b"], specs)
    assert verdicts["b"].not_judged == [{"test": "differential:pp2xvpp2", "why": "needs EP > 1"}]
    assert verdicts["b"].passed  # not judged is not a failure, and never a pass either
    _, _, problems = judge({"pp2xep2": [{}]}, ["a"], specs)
    assert problems == ["pp2xep2: the run with every plugin off failed: nothing judged"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"loss_bound": 1.5}, "loss_bound: must be a number in [0, 1)"),
        ({"norm_bound": True}, "norm_bound: must be a number"),
        ({"env": {"X": 1}}, "env: must be an object of variable -> string"),
        ({"not_in_layouts": {"pp2xvpp2": ""}}, "not_in_layouts: must be an object of layout"),
        ({"bound": 0.1}, "differential.bound: unknown field"),
    ],
)
def test_a_bad_differential_section_is_refused_by_field(section: dict, message: str) -> None:
    with pytest.raises(selection.SelectionError, match=message.replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)")):  # fmt: skip
        selection.parse({"differential": section}, "x/upstream_tests.json")


def _install_fixtures(root: Path) -> None:
    """The two broken plugins, discoverable by entry point from ``root`` (importlib.metadata
    finds the dist-info folder on sys.path, which spawned workers inherit)."""
    write_dist_info(
        root,
        "titan-verify-fixtures",
        {"verify_perturb": "titan_verify_perturb", "verify_idle": "titan_verify_idle"},
    )


@pytest.mark.multiprocess
def test_verify_names_a_plugin_that_perturbs_the_numbers_and_one_that_does_nothing(
    tmp_path, monkeypatch
) -> None:
    _install_fixtures(tmp_path)
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = differential.run(["verify_idle", "verify_perturb"], ["pp2xep2"])
    assert not result.passed
    perturb, idle = result.plugins["verify_perturb"], result.plugins["verify_idle"]
    assert perturb.problems and "losses differ from the off run" in perturb.problems[0]
    # 1% on every column-parallel output moves the loss by about 1e-3 relative (9.0e-4 on one
    # machine, more on another: bf16 CPU kernels differ); anything above 0 is named
    assert perturb.runs["pp2xep2"]["max_loss_gap"] > 1e-4
    assert perturb.runs["pp2xep2"]["effects"]["verify_perturb"]["router"] > 0
    # the idle plugin changed nothing (bit-identical) and is named for doing nothing
    assert idle.runs["pp2xep2"]["max_loss_gap"] == 0.0
    assert idle.problems == ["pp2xep2: applied and did nothing: no work counted in the run "
                             "(titan_effects unchanged)"]  # fmt: skip


@pytest.mark.multiprocess
def test_the_kimi_shaped_layout_names_a_plugin_that_breaks_only_mla_or_the_shared_expert(
    tmp_path, monkeypatch
) -> None:
    # neither is called by the MoE GPT (no MLA, no shared expert): only the Kimi-shaped model
    # can show that they change the numbers
    write_dist_info(
        tmp_path,
        "titan-verify-kimi-fixtures",
        {"verify_break_mla": "titan_verify_break_mla", "verify_break_shared": "titan_verify_break_shared"},
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = differential.run(["verify_break_mla", "verify_break_shared"], ["kimi_pp2xep2"])
    assert not result.passed
    for name, counter in (("verify_break_mla", "mla"), ("verify_break_shared", "shared_expert")):
        verdict = result.plugins[name]
        assert verdict.problems and "losses differ from the off run" in verdict.problems[0], name
        # 1% on one module's output: 7.8e-5 relative on the loss for MLA here; bit-identical
        # (0.0) is what a plugin that changes nothing gives
        assert verdict.runs["kimi_pp2xep2"]["max_loss_gap"] > 0.0, name
        assert verdict.runs["kimi_pp2xep2"]["effects"][name][counter] > 0, name


@pytest.mark.multiprocess
def test_titan_plugins_verify_passes_every_plugin_this_project_ships(tmp_path) -> None:
    report = tmp_path / "verify.json"
    done = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli", "verify", "--json", str(report)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "verdict: PASS" in done.stdout
    assert "Megatron-LM's own unit tests were not run" in done.stdout
    found = json.loads(report.read_text())
    assert set(FIRST_PARTY) <= set(found["plugins"]), sorted(found["plugins"])
    for name in FIRST_PARTY:
        entry = found["plugins"][name]
        assert entry["regressions"] == [], (name, entry)
        judged = found["differential"]["plugins"][name]["runs"]
        if name == "moe_ep_overlap":  # megatron's flex dispatcher refuses EP = 1
            assert sorted(judged) == ["kimi_pp2xep2", "pp2xep2"], judged
        else:
            assert sorted(judged) == ["kimi_pp2xep2", "pp2xep2", "pp2xvpp2"], (name, judged)
    assert found["differential"]["verdict"] == "PASS"
    assert found["seconds"] < 30 * 60  # the budget for the default check on 2 cores


def test_runs_the_budget_left_out_are_not_judged_and_never_pass() -> None:
    ranks = [_rank({OFF: ([2.0], [1.0], {}), "+a": ([2.0], [1.0], {"a": {"n": 1.0}})})]
    specs = {"a": selection.Differential(), "b": selection.Differential()}
    verdicts, _, problems = judge(
        {"pp2xep2": ranks}, ["a", "b"], specs, [("pp2xep2", "+b"), ("pp2xvpp2", OFF)]
    )
    assert verdicts["a"].label == "PASS" and verdicts["b"].label == "NOT JUDGED"
    why = {"test": "differential:pp2xep2", "why": "not run: the time budget ran out"}
    assert why in verdicts["b"].not_judged
    assert {j["test"] for j in verdicts["a"].not_judged} == {"differential:pp2xvpp2"}
    result = differential.DifferentialResult(verdicts, {}, problems, 1.0, ["pp2xep2 +b"])
    assert result.passed and result.verdict == "INCOMPLETE"


def test_a_folder_that_is_not_a_megatron_checkout_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a Megatron-LM checkout"):
        differential.run(["act_offload"], ["pp2xep2"], megatron_lm=str(tmp_path))


MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR", "")


@pytest.mark.multiprocess
@pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="opt-in: MEGATRON_LM_DIR=<a Megatron-LM checkout> (command in docs/hosts.md)",
)
def test_verify_runs_the_unit_tests_of_and_trains_with_a_megatron_lm_checkout(tmp_path) -> None:
    report = tmp_path / "verify.json"
    # 1 rank: the 8-rank jobs of the default selection do not fit 2 cores yet (docs/hosts.md)
    done = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli", "verify", "--megatron-lm", MEGATRON_LM_DIR,
         "--world-sizes", "1", "--json", str(report)],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    found = json.loads(report.read_text())
    checkout = str(Path(MEGATRON_LM_DIR).resolve())
    assert found["differential"]["megatron"].endswith(f"from {checkout}"), found["differential"]
    assert all(entry["regressions"] == [] for entry in found["plugins"].values())
    # the checkout's own unit tests ran for every plugin with selected files, in both modes
    for name, entry in found["plugins"].items():
        no_files = [j for j in entry["not_judged"] if j["test"] == "megatron_lm_tests"]
        if not no_files:  # it has upstream files (weight_sync's patches serve SGLang and slime)
            assert entry["passed_off"] >= 20 and entry["passed_on"] >= 20, (name, entry)
    assert found["upstream"]["launches"], found["upstream"]
