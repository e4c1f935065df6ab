"""The Kimi-K2 1T launch script: ``plan`` reads it; Megatron-LM accepts its flags (parse + validate).

The Megatron-LM check needs ``megatron.training``: the megatron-core wheel ships it from 0.17; on
the 0.16 line it takes a Megatron-LM checkout on PYTHONPATH, and without one it is skipped there
with the reason. It builds the tokenizer where the line keeps it (``megatron.training.tokenizer``
up to 0.16, ``megatron.core.tokenizers`` from 0.17) and compares padded vocabulary and FLOPs with
the plan's on the line it runs on.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.plan.cli import plan_from_argv
from titan_plugins.plan.script import read_launch_script

SCRIPT = Path(__file__).resolve().parents[1] / "entrypoints" / "pretrain_kimi_1000B.sh"


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {
            "NNODES": "32",
            "EP": "8",
            "FP8_ARGS": "",
            "PP": "8",
            "DATA_ARGS": "--data-path /d/text --tokenizer-type HuggingFaceTokenizer "
            "--tokenizer-model moonshotai/Kimi-K2-Instruct",
        },
    ],
)
def test_static_reader_agrees_with_bash(tmp_path: Path, env: dict) -> None:
    """What ``plan`` reads equals what bash would hand to torchrun (a stand-in prints argv)."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@"\n')
    fake.chmod(0o755)
    run_env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", **env}
    out = subprocess.run(["bash", str(SCRIPT)], env=run_env, capture_output=True, check=True)
    argv = out.stdout.decode().split("\0")[:-1]
    entry = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    launch = read_launch_script(SCRIPT.read_text(), env)
    assert launch.megatron_args == argv[entry + 1 :]
    nnodes = int(argv[argv.index("--nnodes") + 1])
    assert launch.world_size == nnodes * int(argv[argv.index("--nproc-per-node") + 1])
    plan = plan_from_argv([str(SCRIPT)], env=env)  # and the adapted layout plans
    assert plan["parallel"]["world"] == launch.world_size


def test_plan_reads_the_script_and_its_titan_switches() -> None:
    launch = read_launch_script(SCRIPT.read_text(), {})
    assert launch.world_size == 4096
    assert launch.variables["TITAN_FP8_BLOCKWISE"] == "1"
    assert launch.megatron_args[launch.megatron_args.index("--fp8-recipe") + 1] == "blockwise"
    assert "--mock-data" in launch.megatron_args  # no DATA_PATH given


_VALIDATE = """
import importlib.util, sys, types
if importlib.util.find_spec("triton") is None:
    # CPU-only hosts: megatron.training imports batch_invariant_kernels, which needs triton at
    # import time; a stand-in is enough for argument parsing (nothing runs a kernel).
    import megatron.core.transformer, torch._inductor.runtime.hints  # before the stand-in
    class _Any(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any(name)
        def __call__(self, *a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else self
    for name in ("triton", "triton.language", "triton.runtime"):
        sys.modules[name] = _Any(name)
import torch
if not torch.cuda.is_available():  # validate as on the H100/H800-class GPU the script targets
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
import megatron.training.arguments as A
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
args = A.parse_args()
A.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
print("VALID", args.virtual_pipeline_model_parallel_size, args.data_parallel_size)
try:  # Megatron-LM up to 0.16 (a checkout): megatron/training/tokenizer
    from megatron.training.tokenizer import build_tokenizer
except ModuleNotFoundError as missing:  # from 0.17 global_vars builds it with megatron.core's
    if missing.name != "megatron.training.tokenizer":
        raise
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training.training import num_floating_point_operations
build_tokenizer(args)  # sets args.padded_vocab_size the way pretrain does
print("PADDED_VOCAB", args.padded_vocab_size)
print("FLOPS", num_floating_point_operations(args, args.global_batch_size))
"""


@pytest.mark.skipif(
    not _has_megatron_training(),
    reason="megatron.training not importable: the 0.16 wheel lacks it (set PYTHONPATH to a checkout)",
)
def test_megatron_lm_parses_and_validates_the_flags() -> None:
    launch = read_launch_script(SCRIPT.read_text(), {})
    env = dict(os.environ, WORLD_SIZE=str(launch.world_size), RANK="0", LOCAL_RANK="0")
    proc = subprocess.run(
        [sys.executable, "-c", _VALIDATE, *launch.megatron_args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VALID 2 256" in proc.stdout  # VPP 2 from the layout, DP = 4096 / PP16
    # plan's vocabulary padding and FLOPs agree with Megatron-LM's own (MFU uses these FLOPs)
    values = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    plan = plan_from_argv([str(SCRIPT)], env={})
    assert int(values["PADDED_VOCAB"]) == plan["model"]["vocab_padded"]
    assert float(values["FLOPS"]) == pytest.approx(plan["flops_per_step"], rel=1e-9)
