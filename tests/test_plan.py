"""``plan`` unit tests: flag handling, script reading, schedule counts, Kimi-K2's published figure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from titan_plugins.plan.cli import main, plan_from_argv
from titan_plugins.plan.flags import PlanError, parse_flags
from titan_plugins.plan.from_flags import build_config
from titan_plugins.plan.memory import stage_memory, stage_schedule
from titan_plugins.plan.script import read_launch_script

KIMI = Path(__file__).resolve().parents[1] / "entrypoints" / "pretrain_kimi_1000B.sh"
GIB = 2**30
SMALL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 1 --vocab-size 128"
).split()


def _plan(argv: list[str]) -> dict:
    return plan_from_argv(argv, env={})


def test_kimi_states_match_published_30gb() -> None:
    """Kimi-K2 report: ~30 GB of states per GPU at PP16 x EP16, ZeRO-1, 4096 GPUs.

    Assumptions that give the figure: bf16 parameters (2 B), fp32 main-grad buffer (4 B),
    distributed optimizer with fp32 main params + Adam m, v (12 B) sharded over DP 256 (dense)
    and expert-DP 16 (experts), the busiest rank of the published layout (4 MoE layers: 24 of 384
    experts per layer), GiB units. SimuMax gives 24.4 / 29.9 / 21.6 for first/middle/last stage.
    """
    rep = _plan([str(KIMI)])
    assert rep["parallel"]["world"] == 4096 and rep["parallel"]["expert_dp"] == 16
    assert rep["model"]["params_total"] == pytest.approx(1026.4e9, rel=1e-3)  # SimuMax 1026.41B
    assert rep["model"]["params_active"] == pytest.approx(32.86e9, rel=1e-3)
    states = [s["states_bytes"] / GIB for s in rep["stages"]]
    assert max(states) == pytest.approx(30.0, rel=0.05)
    assert states[0] == pytest.approx(24.4, abs=0.1) and states[-1] == pytest.approx(21.6, abs=0.1)
    assert rep["stages"][1]["layers"] == [[1, 2], [33, 34]]


def test_kimi_fit_advice_on_80gb() -> None:
    rep = _plan([str(KIMI), "--device-memory", "80GB"])
    assert rep["fits"] is False and rep["fits_with"]["act_offload"] is True
    assert any("TITAN_ACT_OFFLOAD=1" in tip for tip in rep["advice"])


def test_script_variables_follow_environment() -> None:
    launch = read_launch_script(KIMI.read_text(), {"NNODES": "32", "EP": "8"})
    assert launch.world_size == 256
    flags = parse_flags(launch.megatron_args)
    assert flags["--expert-model-parallel-size"] == "8"
    assert flags["--recompute-modules"] == ["layernorm", "mla_up_proj", "moe_act"]
    assert flags["--pipeline-model-parallel-layout"] == "Et|(tt|)*30L"
    assert flags["--moe-layer-freq"] == "([0]*1+[1]*60)"


def test_script_reader_bash_subset() -> None:
    text = """
    A=${A:-3}
    : "${B:=x y}"
    ARGS=(
        --one "$B"   # a comment (with parens)
        --two $((A * 2))
    )
    ARGS+=(--three)
    EXTRA="--x 1 --y 2"
    torchrun --nnodes=2 --nproc_per_node 4 run.py "${ARGS[@]}" $EXTRA ${UNSET:+--no} 2>&1 | tee log
    """
    launch = read_launch_script(text, {}, entry="run.py")
    assert launch.world_size == 8
    assert launch.megatron_args == ["--one", "x y", "--two", "6", "--three", "--x", "1", "--y", "2"]


def test_unknown_flag_is_named_with_suggestion() -> None:
    with pytest.raises(PlanError, match=r"--num-layer\b.*--num-layers"):
        parse_flags(["--num-layer", "2"])


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--bf16", "--fp16"], "--bf16 contradicts --fp16"),
        (["--num-experts", "6", "--expert-model-parallel-size", "4"], "--num-experts 6"),
        (["--fp8-recipe", "blockwise", "--bf16"], "--fp8-recipe needs --fp8-format"),
        (["--pipeline-model-parallel-size", "3"], "--num-layers 4"),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-model-parallel-layout",
                "Et|tt|tL",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            "--num-virtual-stages-per-pipeline",
        ),
        (["--moe-layer-freq", "([0]+[1]*2)", "--num-experts", "4"], "--moe-layer-freq"),
        (["--hidden-size"], "--hidden-size needs a value"),
        (["--swiglu", "yes"], "--swiglu is a switch"),
        (["--tensor-model-parallel-size", "5"], "--tensor/--pipeline/--expert-model-parallel"),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--global-batch-size",
                "12",
            ],
            "--global-batch-size 12 gives 1",
        ),
    ],
)
def test_bad_input_names_the_flag(extra: list[str], named: str) -> None:
    with pytest.raises(PlanError, match=re.escape(named)):
        stage_memory(build_config(parse_flags(SMALL + extra), world=24))


def test_main_reports_errors_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--world-size", "1", "--", *SMALL, "--frobnicate"]) == 2
    assert "--frobnicate" in capsys.readouterr().err


def test_main_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--world-size", "2", "--json", "--step-time", "1", "--peak-tflops", "1", "--", *SMALL]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["mfu"] == pytest.approx(rep["flops_per_step"] / 2e12)
    assert len(rep["stages"]) == 1


def _pipeline(pp: int, gbs: int, *extra: str, vpp: int = 1, world: int | None = None) -> list[str]:
    """SMALL flags with PP (and VPP), one layer per virtual stage, and a global batch size."""
    flags = SMALL + ["--num-layers", str(pp * vpp), "--pipeline-model-parallel-size", str(pp)]
    flags += ["--global-batch-size", str(gbs), *extra]
    if vpp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    return ["--world-size", str(world or pp), "--", *flags]


def _config(argv: list[str]):
    world = int(argv[1])
    return build_config(parse_flags(argv[3:]), world=world)


@pytest.mark.parametrize(
    ("pp", "vpp", "rank", "expected"),
    [
        (4, 1, 0, 3),
        (4, 1, 3, 0),  # 1F1B: pp - rank - 1 warm-up forwards
        (4, 2, 0, 10),
        (4, 2, 3, 4),  # interleaved: 2 (pp - rank - 1) + (vpp - 1) pp
    ],
)
def test_warmup_counts_follow_megatron(pp: int, vpp: int, rank: int, expected: int) -> None:
    cfg = _config(_pipeline(pp, 16, vpp=vpp))
    schedule = stage_schedule(cfg, rank)
    assert schedule.warmup == expected
    assert len(schedule.units()) == 16 * vpp and schedule.steady == 16 * vpp - expected


def test_microbatch_group_size_sets_the_interleaved_warmup() -> None:
    """--microbatch-group-size-per-virtual-pipeline-stage replaces PP in the warm-up count
    (the plan used to ignore it): 2 (pp - rank - 1) + (vpp - 1) group."""
    argv = _pipeline(4, 16, "--microbatch-group-size-per-virtual-pipeline-stage", "8", vpp=2)
    cfg = _config(argv)
    stages = stage_memory(cfg, effects=())
    assert [stage_schedule(cfg, r).warmup for r in range(4)] == [14, 12, 10, 8]
    assert [s.in_flight for s in stages] == [15, 13, 11, 9]


def test_interleaved_refuses_a_short_last_group() -> None:
    """megatron refuses microbatches whose last group is shorter than PP (plan used to plan it)."""
    with pytest.raises(PlanError, match=r"6 microbatches in groups of 4 leave a last group of 2"):
        _plan(_pipeline(4, 12, vpp=2, world=8))


def test_ep_overlap_adds_a_warmup_forward_with_layout_virtual_stages() -> None:
    """EP A2A overlap runs one more warm-up forward under the interleaved schedule, also when a
    layout string (not a flag) sets the virtual stages (plan used to miss that case)."""
    flags = SMALL + ["--num-experts", "4", "--expert-model-parallel-size", "2"]
    flags += ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    flags += ["--pipeline-model-parallel-layout", "Et|t|t|tL"]
    plain = _plan(["--world-size", "4", "--", *flags])
    overlap = _plan(["--world-size", "4", "--", *flags, "--overlap-moe-expert-parallel-comm"])
    assert plain["parallel"]["vpp"] == 2
    assert [s["in_flight_units"] for s in plain["stages"]] == [5, 3]
    assert [s["in_flight_units"] for s in overlap["stages"]] == [6, 4]


def test_ep_overlap_with_pipelining_needs_virtual_stages() -> None:
    argv = _pipeline(2, 8, "--num-experts", "4", "--overlap-moe-expert-parallel-comm")
    with pytest.raises(PlanError, match="needs virtual stages"):
        _plan(argv)


def test_in_flight_microbatches_under_1f1b() -> None:
    rep = _plan(_pipeline(4, 8, "--num-layers", "4"))
    assert [s["in_flight_units"] for s in rep["stages"]] == [4, 3, 2, 1]
    per_mb = rep["stages"][1]["activation_bytes_per_microbatch"]
    assert rep["stages"][1]["activation_peak_bytes"]["configured"] == pytest.approx(3 * per_mb)
