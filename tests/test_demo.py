"""The README's main job, run as a user runs it: ``scripts/demo.sh`` with each documented option and
layout (``--report``, ``--inject-fault``, ``NPROC=2``, ``--pp 1 --ep 2``, ``--pp 2 --ep 1``,
``--vpp 2``), judged by what the job printed and by its JSON report after the run.

Each run starts torchrun with 2 or 4 CPU workers (30-60 s on 2 cores), so there is one run per
layout and each combines the options it can judge (the report, trace capture and an injected
fault: 4 runs where there were 7); the layout rules themselves are unit-tested below without
processes.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from titan_entrypoints import demo_layout
from titan_entrypoints.demo_layout import LayoutError, resolve

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ("rewind", "trace_analysis", "act_offload", "fp8_blockwise", "moe_ep_overlap", "pp_rdma")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo(
    out: Path, *args: str, nproc: int = 4, env: dict[str, str] | None = None
) -> tuple[int, str, dict[str, Any] | None]:
    """Run ``scripts/demo.sh ARGS`` with ``NPROC=nproc`` and its output in ``out``; the exit
    status, everything it printed, and its ``--report`` (strict JSON) when it wrote one."""
    env = {**os.environ, **(env or {})}
    env.pop("TITAN_PLUGINS_AUTOLOAD", None)  # the test session's own setting; a user has none
    # The demo runs on the line this session tests (its venv is already built), not on the
    # default line, which a run of the 0.16 line would otherwise install mid-test.
    env.setdefault("MEGATRON_CORE", _session_line())
    env.update(NPROC=str(nproc), MASTER_PORT=str(_free_port()))
    report = out / "report.json"
    done = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh"), "--out", str(out), "--report", str(report), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = done.stdout + done.stderr
    data = None
    if report.exists():
        data = json.loads(report.read_text(), parse_constant=_no_constants)
    return done.returncode, text, data


def _session_line() -> str:
    """The pinned megatron-core release of this session's venv, without the ``+sha`` that 0.18+
    appends from the working directory's git."""
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]


def _no_constants(name: str) -> Any:
    raise AssertionError(f"the report is not strict JSON: it holds {name}")


def _effects(data: dict[str, Any], plugin: str, measure: str) -> list[Any]:
    return [(rank or {}).get(plugin, {}).get(measure) for rank in data["effects_per_rank"]]


# ---------------------------------------------------------------------------------- layouts


def test_the_layout_left_open_fits_the_processes() -> None:
    assert resolve(4, None, None, None, 4) == demo_layout.Layout(2, 2, None)
    assert resolve(2, None, None, None, 4) == demo_layout.Layout(2, 1, None)
    assert resolve(2, 1, None, None, 4) == demo_layout.Layout(1, 2, None)
    assert resolve(2, None, None, 2, 4) == demo_layout.Layout(2, 1, 2)
    assert resolve(1, None, None, None, 4) == demo_layout.Layout(1, 1, None)
    assert resolve(4, 1, 2, None, 4) == demo_layout.Layout(1, 2, None)  # DP 2 x EP 2


@pytest.mark.parametrize(
    ("nproc", "pp", "ep", "vpp", "says"),
    [
        (2, 2, 2, None, "--pp 2 x --ep 2 needs a multiple of 4 processes"),
        (2, None, 3, None, "cannot split the demo's 4 experts over EP=3"),
        (1, None, None, 2, "--vpp 2 needs PP >= 2"),
        (4, 1, None, 2, "--vpp 2 needs --pp 2 or more"),
        (0, None, None, None, "NPROC=0"),
        (4, 0, None, None, "--pp 0"),
    ],
)
def test_a_layout_that_cannot_run_is_one_line_naming_the_flags(
    nproc: int, pp: int | None, ep: int | None, vpp: int | None, says: str
) -> None:
    with pytest.raises(LayoutError) as err:
        resolve(nproc, pp, ep, vpp, 4)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_demo_sh_refuses_a_layout_before_any_worker_starts(tmp_path: Path) -> None:
    code, text, data = _demo(tmp_path, "--pp", "2", "--ep", "2", nproc=2)
    assert code == 2 and data is None
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines == [
        "demo: --pp 2 x --ep 2 needs a multiple of 4 processes (PP x EP), got NPROC=2; run with "
        "--pp 2 --ep 1 or --pp 1 --ep 2 on NPROC=2, or set NPROC to a multiple of PP x EP"
    ]


def test_preflight_passes_every_other_argument_through_quoted(capsys: Any) -> None:
    assert demo_layout.preflight(["2", "--steps", "3", "--pp=2", "--out", "a b"]) == 0
    assert capsys.readouterr().out.strip() == "--pp 2 --ep 1 --steps 3 --out 'a b'"


# ---------------------------------------------------------------------------------- the runs


# One run per layout, each judging every option it can: the report, trace capture and an
# injected fault share a run (each launch costs 30-60 s of start-up on 2 cores).


def _fault_rolled_back(text: str, data: dict[str, Any], step: int, steps: int, ranks: int) -> None:
    """``--inject-fault STEP`` (README: watch rewind roll back and go on). Below step 5 with the
    defaults the only target is the starting state (steps 1 and 3 used to stop every rank with
    'nothing to roll back to'); at step 8 it is the snapshot of step 0, stable after step 5."""
    assert _effects(data, "rewind", "rewinds") == [1] * ranks
    assert _effects(data, "rewind", "last_rewind_step") == [step] * ranks
    restored = -1 if step < 6 else 0  # -1: the starting state, before step 0
    assert _effects(data, "rewind", "last_restored_step") == [restored] * ranks
    assert f"rewind: step {step}: nonfinite_loss" in text
    assert f"trained {steps} steps" in text
    losses = [float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")]
    assert len(losses) == steps
    assert all(math.isfinite(x) for i, x in enumerate(losses) if i != step)


@pytest.mark.multiprocess
def test_default_demo_writes_a_strict_json_report_with_every_plugins_work(tmp_path: Path) -> None:
    """README: ``./scripts/demo.sh --steps N --report PATH`` (it crashed after training), with
    trace capture and ``--inject-fault 8`` in the same run."""
    code, text, data = _demo(tmp_path, "--steps", "10", "--inject-fault", "8")
    assert code == 0, text[-3000:]
    assert data is not None and len(data["effects_per_rank"]) == 4
    assert "layout: --pp 2 --ep 2 on 4 processes" in text
    assert _effects(data, "rewind", "steps_checked") == [10] * 4
    assert all(n > 0 for n in _effects(data, "fp8_blockwise", "fp8_gemms"))
    assert all(n > 0 for n in _effects(data, "pp_rdma", "inline_messages"))
    assert all(n > 0 for n in _effects(data, "moe_ep_overlap", "api_dispatches"))
    offloaded = _effects(data, "act_offload", "offloaded_bytes")
    assert offloaded[0] > 0 and offloaded[1] > 0  # pipeline stage 0 holds the in-flight work
    assert _effects(data, "trace_analysis", "trace_files_written") == [1] * 4
    # act_offload's own report keys its units by (chunk, microbatch) tuples: now "0,1" text.
    act_offload = next(p for p in data["report"]["plugins"] if p["name"] == "act_offload")
    assert act_offload["report"]["stats"]["unit_bytes"]
    # The trace summary still follows the report.
    assert text.index("report written to") < text.index("trace analysis of the captured steps")
    assert "4 ranks analysed" in text
    _fault_rolled_back(text, data, step=8, steps=10, ranks=4)


@pytest.mark.multiprocess
def test_the_kimi_shaped_model_gets_every_plugins_work(tmp_path: Path) -> None:
    """``./scripts/demo.sh --model kimi`` (issue 44): Kimi-K2's architecture at tiny size (MLA, a
    dense first layer, a shared expert, a sigmoid router with expert bias) at PP=2 x EP=2, with
    every plugin's work measured after the run, the report and the trace summary."""
    code, text, data = _demo(tmp_path, "--model", "kimi", "--steps", "6")
    assert code == 0, text[-3000:]
    assert "model: kimi, 4 layers; layout: --pp 2 --ep 2 on 4 processes" in text
    assert data is not None and len(data["effects_per_rank"]) == 4
    assert _effects(data, "rewind", "steps_checked") == [6] * 4
    assert all(n > 0 for n in _effects(data, "fp8_blockwise", "fp8_gemms"))
    assert all(n > 0 for n in _effects(data, "pp_rdma", "inline_messages"))
    assert all(n > 0 for n in _effects(data, "moe_ep_overlap", "api_dispatches"))
    offloaded = _effects(data, "act_offload", "offloaded_bytes")
    assert offloaded[0] > 0 and offloaded[1] > 0  # stage 0: its MLA layers' saved tensors
    assert _effects(data, "trace_analysis", "trace_files_written") == [1] * 4
    assert "4 ranks analysed" in text
    losses = [float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("args", "layout", "fault", "steps"),
    [
        ((), "--pp 2 --ep 1", 1, 4),
        (("--pp", "2", "--ep", "1", "--vpp", "2"), "--pp 2 --ep 1 --vpp 2", 3, 5),
    ],
    ids=["NPROC=2", "pp2-ep1-vpp2"],
)
def test_two_pipeline_stages_without_expert_parallelism(
    tmp_path: Path, args: tuple[str, ...], layout: str, fault: int, steps: int
) -> None:
    """``NPROC=2 ./scripts/demo.sh`` (the README's example failed inside Megatron) picks PP=2 x
    EP=1; there, and with ``--pp 2 --ep 1 --vpp 2`` (flex was asserted by Megatron), the demo keeps
    alltoall where Megatron refuses flex, and moe_ep_overlap says that it stands aside. Each run
    also rolls back a fault injected before rewind's first stable snapshot."""
    code, text, data = _demo(
        tmp_path, "--steps", str(steps), "--inject-fault", str(fault), *args, nproc=2
    )
    assert code == 0, text[-3000:]
    assert f"layout: {layout} on 2 processes" in text
    assert data is not None
    assert _effects(data, "moe_ep_overlap", "stepped_aside") == ["TP x EP = 1"] * 2
    assert _effects(data, "moe_ep_overlap", "api_dispatches") == [None, None]  # no zero rows
    assert "stepped aside: TP x EP = 1" in text
    assert all(n > 0 for n in _effects(data, "pp_rdma", "inline_messages"))
    assert _effects(data, "rewind", "steps_checked") == [steps, steps]
    _fault_rolled_back(text, data, step=fault, steps=steps, ranks=2)


@pytest.mark.multiprocess
def test_two_processes_expert_parallel_only(tmp_path: Path) -> None:
    """``NPROC=2 ./scripts/demo.sh --pp 1 --ep 2``: the flex path runs on our backend."""
    code, text, data = _demo(tmp_path, "--steps", "3", "--pp", "1", "--ep", "2", nproc=2)
    assert code == 0, text[-3000:]
    assert data is not None
    assert all(n > 0 for n in _effects(data, "moe_ep_overlap", "api_dispatches"))
    assert _effects(data, "moe_ep_overlap", "stepped_aside") == [None, None]
    assert all(n > 0 for n in _effects(data, "fp8_blockwise", "fp8_gemms"))


@pytest.mark.multiprocess
def test_nothing_to_roll_back_ends_the_job_with_one_message(tmp_path: Path) -> None:
    """With a host budget too small for any snapshot, a NaN cannot be rolled back: one message
    naming the step and the knob, exit 3, no traceback from any rank."""
    code, text, _ = _demo(
        tmp_path,
        "--steps", "4", "--inject-fault", "1", "--trace-steps", "none", "--pp", "2", "--ep", "1",
        nproc=2, env={"TITAN_REWIND_MAX_HOST_BYTES": "1"},
    )  # fmt: skip
    assert code == 3, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("RewindError:")]
    assert len(starts) == 1, text[-3000:]
    # the message leads with the last steps' losses, then names the step and the knob
    message = lines[starts[0] :]
    assert "the last 2 step(s) before the stop" in message[0]
    assert re.fullmatch(r"  step 0: loss \d+\.\d+, grad norm \d+\.\d+", message[1]), message
    assert message[2] == "  step 1: loss nan/inf, grad norm nan/inf (nonfinite_loss)"
    assert message[3].startswith("rewind: step 1: nonfinite_loss nan, and nothing to roll back")
    assert "TITAN_REWIND_MAX_HOST_BYTES" in text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
