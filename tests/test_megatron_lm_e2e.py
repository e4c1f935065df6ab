"""Unmodified Megatron-LM ``pretrain_gpt.py`` on CPU, with the plugins installed for real.

Needs a Megatron-LM checkout of a supported line (core_v0.16.1 .. core_v0.19.x) named by
``MEGATRON_LM_DIR`` (docs/hosts.md says how to get one); skipped otherwise, so CI (no checkout)
pays nothing. The line is read from the checkout's ``megatron/core/package_info.py``, and the
test runs on that line's Python (``scripts/megatron_line.sh``: 3.11 for 0.16, 3.12 from 0.17),
so it is skipped, saying which venv to use, when another interpreter runs it. The runs happen in
a fresh venv of that Python that has the Titan distributions installed (non-editable) and **no
megatron-core distribution**: Megatron comes only from the checkout on ``PYTHONPATH``, as
Megatron-LM users and slime's scripts run it. Each run is ``torchrun`` with 4 ranks (PP=2 x
EP=2, DP=2) of ``python -m titan_plugins.testing.megatron_lm pretrain_gpt.py ...``: the CPU
harness plus the few ``megatron.training`` shims, then the script untouched. Plugins arrive
through the torch.backends entry point. Each rank writes its plugin report and its
per-iteration losses at full precision (``--report-dir``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from titan_plugins.hosts.megatron.lines import MEGATRON_LINES
from titan_plugins.patching import APPLIED, OTHER_LINE, PENDING, gates
from titan_plugins.patching.origin import read_package_info
from titan_plugins.testing.freshenv import clean_env, make_venv, pip_install

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(
    p for p in (ROOT / "plugins").iterdir() if (p / "setup.cfg").exists() and p.name[0] != "_"
)
CHECKOUT = Path(os.environ.get("MEGATRON_LM_DIR", "/nonexistent"))
# megatron.training imports these beyond megatron-core's own needs; pybind11 builds the dataset
# helpers the checkout ships as C++ source (megatron's compile_helpers runs `make` on rank 0).
TRAINING_DEPS = ("six", "regex", "pydantic", "pybind11")
ITERATIONS = 5


def _line_pythons() -> dict[str, tuple[str, str]]:
    """Megatron line -> (its Python, its venv), as ``scripts/megatron_line.sh`` pins them."""
    text = (ROOT / "scripts" / "megatron_line.sh").read_text()
    default = re.search(r"^DEFAULT_MEGATRON_CORE=(\S+)", text, re.M)
    lines: dict[str, tuple[str, str]] = {}
    for pins, python in re.findall(r"^\s*([0-9. |]+)\)\s*LINE_PYTHON=([0-9.]+)", text, re.M):
        for pin in (p.strip() for p in pins.split("|")):
            venv = ".venv" if default and pin == default[1] else f".venv-{pin}"
            lines[pin.rsplit(".", 1)[0]] = (python, venv)
    return lines


def _why_not_here() -> str | None:
    """Why this interpreter cannot run the checkout's line (None: it can)."""
    if not (CHECKOUT / "pretrain_gpt.py").is_file():
        return "set MEGATRON_LM_DIR to a Megatron-LM checkout, core_v0.16.1 .. core_v0.19.x"
    if VERSION is None:
        return f"{CHECKOUT}/megatron/core/package_info.py states no megatron-core version"
    if LINE not in MEGATRON_LINES:
        return f"{CHECKOUT} is megatron-core {VERSION}: the plugins serve lines {MEGATRON_LINES}"
    python, venv = _line_pythons().get(LINE, (None, None))
    if python is None:
        return f"scripts/megatron_line.sh names no Python for megatron-core {LINE}"
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if here != python:
        return (
            f"{CHECKOUT} is megatron-core {VERSION}: line {LINE} runs on Python {python}, this "
            f"is {here}; run this test with {venv}/bin/python (scripts/megatron_line.sh)"
        )
    return None


VERSION = read_package_info(CHECKOUT / "megatron" / "core" / "package_info.py")
LINE = ".".join(VERSION.split(".")[:2]) if VERSION else None  # "0.16.0rc0" -> "0.16"
WHY_NOT_HERE = _why_not_here()

pytestmark = [
    pytest.mark.megatron_lm,
    pytest.mark.installed,
    pytest.mark.multiprocess,
    pytest.mark.skipif(WHY_NOT_HERE is not None, reason=f"{WHY_NOT_HERE} (docs/hosts.md)"),
]

# The tiny MoE GPT of docs/hosts.md; hidden 128 so blockwise FP8's 1x128 tiles fit.
MODEL = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--ffn-hidden-size", "256", "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
    "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
    "--transformer-impl", "local", "--distributed-backend", "gloo", "--use-cpu-initialization",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
    "--disable-bias-linear", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--save-interval", "100000",
    "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
]  # fmt: skip
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
FLEX_DEEPEP = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
FP8_BLOCKWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]


@dataclass
class Run:
    """One pretrain_gpt.py run: exit code, output tail, per-rank reports."""

    returncode: int
    output: str
    reports: list[dict[str, Any]]

    def losses(self) -> list[float]:
        """``lm loss`` of each iteration, from the last pipeline stage (full precision)."""
        last = [r for r in self.reports if any(e.get("losses") for e in r["training_log"])]
        assert last, self.output[-3000:]
        log = last[0]["training_log"]
        assert [e["iteration"] for e in log] == list(range(1, ITERATIONS + 1))
        return [e["losses"]["lm loss"] for e in log]

    def grad_norms(self) -> list[float]:
        return [e["grad_norm"] for e in self.reports[0]["training_log"]]

    def patches(self) -> dict[str, tuple[str, str]]:
        """Every plugin patch of rank 0: id -> (status, detail)."""
        return {
            p["id"]: (p["status"], p["detail"])
            for plugin in self.reports[0]["plugins"]
            for p in plugin["patches"]
        }

    def plugin_report(self, name: str, rank: int = 0) -> dict[str, Any]:
        (plugin,) = [p for p in self.reports[rank]["plugins"] if p["name"] == name]
        return plugin["report"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Titan installed for real, Megatron-LM's training deps, and no megatron-core."""
    python = make_venv(tmp_path_factory.mktemp("mlm") / "venv", exclude=("megatron",))
    pip_install(python, ROOT, *PLUGINS)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *TRAINING_DEPS],
        capture_output=True,
        text=True,
    )
    # the package index is part of the README's set-up: a pip failure is a broken set-up
    assert done.returncode == 0, f"pip cannot install {TRAINING_DEPS}: {done.stderr[-500:]}"
    return python


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pretrain(venv: Path, report_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Run:
    """torchrun 4 ranks of unmodified pretrain_gpt.py through the testing launcher."""
    extra = {
        "PYTHONPATH": str(CHECKOUT),
        "PATH": f"{venv.parent}:{os.environ.get('PATH', '')}",  # `make` runs python3 -m pybind11
        # ... and names the helpers after `python3-config`, which a venv lacks: the one found on
        # PATH may be another Python's (pyenv honours the checkout's .python-version, 3.12), and
        # a helpers_cpp built for it does not import here. A make variable set through MAKEFLAGS
        # wins over the Makefile's own.
        "MAKEFLAGS": f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OMP_NUM_THREADS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        **(env or {}),
    }
    for _ in range(3):  # a free port can be taken by another job before torchrun binds it
        command = [
            str(venv), "-m", "torch.distributed.run", "--nproc-per-node", "4",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "-m", "titan_plugins.testing.megatron_lm", "--report-dir", str(report_dir),
            "pretrain_gpt.py", *MODEL, *flags,
        ]  # fmt: skip
        done = subprocess.run(
            command,
            cwd=CHECKOUT,
            env=clean_env(extra),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if "EADDRINUSE" not in done.stderr:
            break
    reports = [json.loads(p.read_text()) for p in sorted(report_dir.glob("rank*.json"))]
    run = Run(done.returncode, done.stdout + done.stderr, reports)
    if done.returncode == 0:  # shown with -s: the figures docs/hosts.md quotes
        print(
            f"\n{' '.join(flags)} {env or ''}: lm loss {run.losses()}, grad norm {run.grad_norms()}"
        )
    return run


@pytest.fixture(scope="module")
def alltoall_on(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = pretrain(venv, tmp_path_factory.mktemp("a_on"), *ALLTOALL)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_a_alltoall_plugins_on_and_off_give_identical_losses(venv, alltoall_on, tmp_path):
    off = pretrain(venv, tmp_path, *ALLTOALL, env={"TITAN_PLUGINS": "0"})
    assert off.returncode == 0, off.output[-4000:]
    assert off.reports[0]["active"] is False
    assert alltoall_on.losses() == off.losses()  # bit for bit: same math, same order
    assert alltoall_on.grad_norms() == off.grad_norms()
    assert alltoall_on.losses()[-1] < alltoall_on.losses()[0]


def test_d_checkout_without_distribution_applies_every_patch(venv, alltoall_on):
    """PYTHONPATH checkout, no megatron-core in the venv: gates read the checkout's code."""
    found = alltoall_on.reports[0]["megatron"]
    # From 0.18 a git checkout appends "+<commit>" when megatron.core.package_info executes.
    assert found["kind"] == "checkout" and found["version"].split("+")[0] == VERSION
    assert Path(found["path"]).resolve() == (CHECKOUT / "megatron" / "core").resolve()
    probe = "import importlib.metadata as m; print(m.version('megatron-core'))"
    absent = subprocess.run([str(venv), "-c", probe], env=clean_env(), capture_output=True)
    assert absent.returncode != 0 and b"PackageNotFoundError" in absent.stderr
    for report in alltoall_on.reports:  # every rank, every patch of this line applied
        patches = [p for pl in report["plugins"] for p in pl["patches"]] + report["core_patches"]
        mine = [p for p in patches if _for_this_line(p, found["version"])]
        assert mine and all(p["status"] == APPLIED for p in mine), mine
        # A variant for another line never applies (its module may never be imported here).
        assert all(p["status"] in (OTHER_LINE, PENDING) for p in patches if p not in mine)


def _for_this_line(patch: dict, version: str) -> bool:
    return all(gates.judge_version(r, version).reason is None for r in patch["requires"])


def test_d_report_import_targets_in_the_checkout_venv(venv):
    """``titan-plugins report --import-targets``: every target module imported, every record of
    this checkout's line applied (the variants for other lines say so: 'other line')."""
    cli = venv.parent / "titan-plugins"
    done = subprocess.run(
        [str(cli), "report", "--import-targets"],
        env=clean_env({"PYTHONPATH": str(CHECKOUT), "TORCH_COMPILE_DISABLE": "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    statuses = {p["id"]: p["status"] for pl in data["plugins"] for p in pl["patches"]}
    assert statuses and set(statuses.values()) <= {APPLIED, OTHER_LINE}, statuses
    assert APPLIED in statuses.values()
    assert data["megatron"]["kind"] == "checkout"


def test_b_flex_deepep_trains_with_the_plugin_and_matches_alltoall(venv, alltoall_on, tmp_path):
    flex = pretrain(venv, tmp_path / "on", *FLEX_DEEPEP)
    assert flex.returncode == 0, flex.output[-4000:]
    assert flex.plugin_report("moe_ep_overlap")["backend"] == "torch.distributed"
    ref, got = alltoall_on.losses(), flex.losses()
    # Same routing and experts. By default `auto` also times the 4-chunk pipeline in some
    # steps, whose results differ from the unchunked path's by an ulp or so (the first loss
    # differed by one ulp on 2026-12-02; with 1 chunk it does not): within 1e-5 relative.
    assert max(abs(g - r) / abs(r) for g, r in zip(got, ref)) < 1e-5, (got, ref)
    # Unchunked (megatron's own flex path through the backend) it is the same math in the same
    # order as alltoall: bit-identical losses and grad norms at every step.
    whole = pretrain(
        venv, tmp_path / "whole", *FLEX_DEEPEP, env={"TITAN_MOE_EP_OVERLAP_CHUNKS": "1"}
    )
    assert whole.returncode == 0, whole.output[-4000:]
    assert whole.losses() == ref, (whole.losses(), ref)
    assert whole.grad_norms() == alltoall_on.grad_norms()
    # Without the plugin's backend megatron refuses the same flags with its own message.
    off = pretrain(venv, tmp_path / "off", *FLEX_DEEPEP, env={"TITAN_MOE_EP_OVERLAP": "0"})
    assert off.returncode != 0 and "DeepEP is not installed" in off.output


def test_c_blockwise_fp8_with_megatron_lm_flags(venv, alltoall_on, tmp_path):
    """``--fp8-format e4m3 --fp8-recipe blockwise``: what a Megatron-LM user passes."""
    fp8 = pretrain(venv, tmp_path, *ALLTOALL, *FP8_BLOCKWISE)
    assert fp8.returncode == 0, fp8.output[-4000:]
    for rank in range(4):
        calls = fp8.plugin_report("fp8_blockwise", rank)["fp8_gemm_calls"]
        # each rank holds one layer: attention + shared linears and 2 local experts, in FP8
        assert calls.get("ColumnParallelLinear", 0) > 0 and calls.get("RowParallelLinear", 0) > 0
        assert calls.get("ColumnParallelLinear.expert", 0) > 0, calls
    ref, got = alltoall_on.losses(), fp8.losses()
    assert got != ref  # FP8 GEMMs really changed the numbers
    # E4M3 with power-of-2 block scales: relative GEMM error ~2^-4 per element, averaging out
    # over K=128..256 terms; the loss of this tiny model moves by < 1%.
    assert max(abs(g - r) / abs(r) for g, r in zip(got, ref)) < 1e-2, (got, ref)
    assert got[-1] < got[0]
