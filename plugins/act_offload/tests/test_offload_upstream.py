"""Megatron's own activation-memory features next to the plugin: where it composes, where it
steps aside, and that it says which (report, effects).

- ``moe_paged_stash`` (0.18+): the stash holds the routed experts' activations, so the MoE blocks
  (``moe``, ``experts``, ``layer``) are left to it; attention and dense MLPs are still offloaded.
  A real paged stash needs TE's grouped MLP and the HybridEP / NCCL-EP dispatcher (neither runs
  here): the flag is set on the built config, which is what the plugin and the schedules read.
- ``fine_grained_activation_offloading``: Megatron takes the saves inside its regions, the plugin
  the rest of the selected blocks, and no tensor is handed to both.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from titan_plugins.hosts.megatron.testing import tiny_gpt
from titan_plugins.testing import plugin_active

pytestmark = pytest.mark.multiprocess

STEPS = 2
ON = {"TITAN_ACT_OFFLOAD_MIN_BYTES": "0", "TITAN_ACT_OFFLOAD_MIN_GAP": "0"}
FINE = {
    "fine_grained_activation_offloading": True,
    "offload_modules": ["core_attn", "attn_proj"],
    "min_offloaded_tensor_size": 1,
}


def _train(overrides: dict, paged_stash: bool) -> dict[str, Any]:
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    PipelineOffloadManager.reset_instance()  # a process singleton holding chunk state
    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_config(**overrides)
    if paged_stash:
        cfg.moe_paged_stash = True  # after validation: see the module docstring
    chunks = tiny_gpt.build_model(cfg)
    losses, norms = tiny_gpt.train(chunks, cfg, STEPS, 2)
    PipelineOffloadManager.reset_instance()
    grads = {k: v for k, v in tiny_gpt.state_snapshot(chunks).items() if k.endswith(".grad")}
    return {"losses": losses, "norms": norms, "grads": grads}


def runs_task(runs: dict[str, tuple[dict | None, dict, bool]]) -> dict[str, Any]:
    """Per name: (plugin env or None for off, config overrides, paged stash?) -> results."""
    from titan_act_offload import plugin, runtime

    out: dict[str, Any] = {}
    for name, (env, overrides, paged_stash) in runs.items():
        if env is None:
            out[name] = _train(overrides, paged_stash)
            continue
        with plugin_active("act_offload", env):
            result = _train(overrides, paged_stash)
            rt = runtime.current()
            result.update(report=plugin.titan_report(), effects=plugin.titan_effects())
            result["offloaded"] = rt.stats.offloaded_bytes if rt.started else 0
        out[name] = result
    return out


def _identical(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert a["grads"].keys() == b["grads"].keys()
    for key, grad in a["grads"].items():
        assert torch.equal(grad, b["grads"][key]), key


def test_paged_stash_leaves_the_moe_blocks_to_megatron(gloo_pool1):
    both = {**ON, "TITAN_ACT_OFFLOAD_MODULES": "attention,moe"}
    runs = {
        "off": (None, {}, True),
        "attention": ({**ON, "TITAN_ACT_OFFLOAD_MODULES": "attention"}, {}, False),
        "no_stash": (both, {}, False),
        "stash": (both, {}, True),
        "moe_only": ({**ON, "TITAN_ACT_OFFLOAD_MODULES": "moe"}, {}, True),
    }
    (result,) = gloo_pool1.run(runs_task, runs, timeout=400)
    for name in ("stash", "moe_only"):
        _identical(result["off"], result[name])
    # With the stash on, the MoE layer's saves are not ours: exactly what attention alone moves.
    stash = result["stash"]
    assert stash["offloaded"] == result["attention"]["offloaded"] > 0
    assert result["no_stash"]["offloaded"] > stash["offloaded"]
    assert stash["effects"]["composes_with"] == "moe_paged_stash"
    assert stash["effects"]["offloaded_bytes"] == stash["offloaded"]
    assert stash["report"]["active"] is True
    assert "moe_paged_stash" in stash["report"]["composes_with"]
    assert "moe" in stash["report"]["composes_with"]
    # Nothing of the selected blocks is left to the plugin: it steps aside and says so.
    alone = result["moe_only"]
    assert alone["offloaded"] == 0
    assert alone["effects"]["stepped_aside"] == "moe_paged_stash"
    assert "offloaded_bytes" not in alone["effects"]  # no row of zeros as if it had run
    assert alone["report"]["active"] is False
    why = alone["report"]["inactive_reason"]
    assert "moe_paged_stash" in why and "TITAN_ACT_OFFLOAD_MODULES" in why
    assert "moe_paged_stash" not in result["no_stash"]["effects"].get("composes_with", "")


def _watch_both() -> tuple[list, list, tuple]:
    """Record the tensors Megatron's offload hook is handed (weakly) and the storages the plugin
    copies to host while they are alive."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
    from titan_act_offload import transfers

    theirs: list[weakref.ref] = []
    clashes: list[int] = []
    manager = fgo.PipelineOffloadManager
    their_pack = manager.on_save_for_backward
    our_offload = transfers.HostCopies.offload

    def on_save(self: Any, tensor: torch.Tensor) -> Any:
        theirs.append(weakref.ref(tensor))
        return their_pack(self, tensor)

    def offload(self: Any, block: Any) -> None:
        alive = {t.untyped_storage().data_ptr() for t in (r() for r in theirs) if t is not None}
        clashes.extend(
            r.device.untyped_storage().data_ptr()
            for r in block.records
            if r.state == "staged" and r.device.untyped_storage().data_ptr() in alive
        )
        return our_offload(self, block)

    manager.on_save_for_backward = on_save  # before reset_instance(): 0.19 binds it at init
    transfers.HostCopies.offload = offload
    return theirs, clashes, (manager, their_pack, our_offload)


def fine_grained_task() -> dict[str, Any]:
    """Plugin plus Megatron's fine-grained offloading, every save watched."""
    from titan_act_offload import transfers

    theirs, clashes, (manager, their_pack, our_offload) = _watch_both()
    try:
        result = runs_task({"both": (ON, FINE, False)})["both"]
    finally:
        manager.on_save_for_backward = their_pack
        transfers.HostCopies.offload = our_offload
    result.update(theirs=len(theirs), clashes=clashes)
    return result


def test_fine_grained_offloading_composes_and_no_tensor_goes_to_both(gloo_pool1):
    (result,) = gloo_pool1.run(fine_grained_task, timeout=400)
    assert result["theirs"] > 0 and result["offloaded"] > 0  # both took saves
    assert result["clashes"] == []
    assert result["effects"]["composes_with"] == "fine_grained_activation_offloading"
    assert result["report"]["active"] is True
    assert "core_attn" in result["report"]["composes_with"]  # which regions are Megatron's
