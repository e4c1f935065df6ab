"""Activation before megatron is imported (the torch.backends autoload / ``apply()`` order):
every patch lands as its module executes, from-import copies see the patched functions, and a
tiny MoE GPT trains in FP8. Runs in a fresh interpreter (megatron must not be imported yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import titan_plugins
activation = titan_plugins.apply(only=["fp8_blockwise"])
assert "megatron.core" not in sys.modules
from titan_plugins.hosts.megatron.testing import cpu_harness
cpu_harness.install()
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from titan_plugins.hosts.megatron.testing import tiny_gpt
tiny_gpt.init_parallel()
from titan_fp8_blockwise import region
cfg = tiny_gpt.make_config(fp8="e4m3", fp8_recipe="blockwise")
losses, _ = tiny_gpt.train(tiny_gpt.build_model(cfg), cfg, 2, num_microbatches=1)
import importlib.util
from megatron.core.transformer import transformer_block
from titan_fp8_blockwise import plugin
mine = [p for p in activation.engine.patches() if p.plugin == "fp8_blockwise"]
print(json.dumps({
    "losses": losses,
    "calls": dict(region.CALLS),
    "block_context_patched": hasattr(transformer_block.get_fp8_context, "__wrapped__"),
    "statuses": {p.id: p.status for p in mine},
    "targets": {p.id: p.target for p in mine},
    "absent": [p.id for p in mine if importlib.util.find_spec(p.module) is None],
    "features": plugin.titan_report()["features"],
}))
dist.destroy_process_group()
"""

pytestmark = pytest.mark.multiprocess


def test_fp8_early_activation_patches_megatron_as_it_imports():
    env = {
        **os.environ,
        "TITAN_PLUGINS_AUTOLOAD": "0",
        "TORCH_COMPILE_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
    }
    for var in [v for v in env if v.startswith("TITAN_FP8_BLOCKWISE")]:
        env.pop(var)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Per target, the variant written for this Megatron line is applied and the others say
    # "other line"; a target module this line does not have (megatron.core.recompute before
    # 0.18) never executes, so its record stays pending.
    statuses, targets = result["statuses"], result["targets"]
    for pid, status in statuses.items():
        expected = {"pending"} if pid in result["absent"] else {"applied", "other line"}
        assert status in expected, (pid, status)
    for target in {targets[pid] for pid in statuses if pid not in result["absent"]}:
        variants = [statuses[pid] for pid in statuses if targets[pid] == target]
        assert variants.count("applied") == 1 or variants == ["other line"], (target, variants)
    assert set(result["features"].values()) == {"active"}, result["features"]
    assert result["block_context_patched"]
    assert result["calls"]["ColumnParallelLinear.expert"] == 8 * 2
    assert result["losses"][1] < result["losses"][0]
