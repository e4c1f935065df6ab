"""The pipelined ``MoELayer.forward`` on each Megatron line (0.16-0.19): it runs, matches
megatron's own flex path, and keeps what that line's forward does.

* Each line has its own record, gated on that line only: on the line installed here exactly that
  one applies (the others are "other line"), and the pipeline really runs.
* 0.16 recomputes a ``recompute_modules=["moe"]`` layer in every mode, 0.17+ only in training:
  the pipeline recomputes exactly when megatron's serial path does (counted in dispatches: a
  forward + backward issues 2 dispatches per chunk, 3 with the recompute), and its results are
  those of the serial path.
* 0.18+ selects its inference dispatcher at the top of the forward while ``InferenceMode`` is
  active: such a call goes to megatron's forward; a later call outside it gets the training
  dispatcher back before the pipeline runs.
* After a pipelined call the dispatcher keeps no received-token metadata (megatron's combine
  releases it from 0.19).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from titan_moe_ep_overlap import moe_forward, stats, upstream_paths

from titan_plugins.hosts.megatron.testing.model_state import outputs_and_grads

EPS32 = torch.finfo(torch.float32).eps
FIXED = {"TITAN_MOE_EP_OVERLAP_BACKEND": "torch", "TITAN_MOE_EP_OVERLAP_AUTO": "0"}
ULPS = 16  # as test_moe_ep_overlap_layer: same math, other GEMM row blocking
FORWARD_TARGET = "megatron.core.transformer.moe.moe_layer:MoELayer.forward"


def _build_layer(cfg):
    """megatron's MoE layer of the local GPT spec (a ModuleSpec up to 0.17, a builder from 0.18)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    mlp = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts).submodules.mlp
    return build_module(mlp, config=cfg) if isinstance(mlp, ModuleSpec) else mlp(config=cfg)


def task_line_forward(seed: int) -> dict:
    """On the installed line: which forward records applied, and per mode (train / eval, grad
    enabled in both) and chunk count (1 = megatron's serial flex path, 2 = the pipeline) the path
    taken, the dispatches issued, the differences to the serial path and the manager's state."""
    import torch.distributed as dist
    from megatron.core import package_info

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=2)
    out: dict = {"line": f"{package_info.MAJOR}.{package_info.MINOR}"}
    with plugin_active("moe_ep_overlap", env=FIXED) as engine:
        cfg = tiny_gpt.make_config(
            num_layers=1, num_moe_experts=4, moe_token_dispatcher_type="flex",
            moe_router_dtype="fp32", recompute_granularity="selective", recompute_modules=["moe"],
        )  # fmt: skip
        layer = _build_layer(cfg)
        out["records"] = {  # judged once moe_layer executed (0.18+ imports it lazily)
            p.id: (p.status, p.requires[0])
            for p in engine.patches()
            if p.plugin == "moe_ep_overlap" and p.target == FORWARD_TARGET
        }
        for p in layer.router.parameters():
            dist.broadcast(p.data, 0)  # the router is replicated across EP ranks
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        x = torch.randn(6 + dist.get_rank(), 2, 64, generator=gen)
        weight = torch.randn(x.shape, generator=gen)
        manager = layer.token_dispatcher._comm_manager
        for mode in ("train", "eval"):
            layer.train(mode == "train")
            runs = {}
            for count in (1, 2):
                os.environ["TITAN_MOE_EP_OVERLAP_CHUNKS"] = str(count)
                stats.reset()
                runs[count] = outputs_and_grads(layer, x, weight)
                out[(mode, count)] = dict(stats.counts())
                out[(mode, count, "kept")] = (
                    manager.handle is None,
                    manager.dispatched_indices is None,
                    manager.dispatched_probs is None,
                )
            out[(mode, "diffs")] = {
                k: ((runs[2][k] - runs[1][k]).abs().max().item(), runs[1][k].abs().max().item())
                for k in runs[1]
            }
    return out


@pytest.mark.multiprocess
def test_the_line_s_forward_variant_runs_and_keeps_its_recompute_rule(gloo_pool2) -> None:
    for res in gloo_pool2.run(task_line_forward, 5):
        line = res["line"]
        applied = [i for i, (status, _) in res["records"].items() if status == "applied"]
        assert len(applied) == 1 and len(res["records"]) == 4, res["records"]
        assert res["records"][applied[0]][1].startswith(f"megatron-core>={line},"), res["records"]
        assert {s for s, _ in res["records"].values()} == {"applied", "other line"}
        for mode in ("train", "eval"):
            serial, piped = res[(mode, 1)], res[(mode, 2)]
            assert (serial["serial_calls"], serial["pipelined_calls"]) == (1, 0), (mode, serial)
            assert (piped["serial_calls"], piped["pipelined_calls"]) == (0, 1), (mode, piped)
            # megatron recomputes the layer in training on every line, in eval only on 0.16:
            # forward + backward is 2 dispatches (forward, cached gradient dispatch), 3 with
            # the recompute's forward
            recomputes = mode == "train" or line == "0.16"
            assert serial["api_dispatches"] == (3 if recomputes else 2), (line, mode, serial)
            # the pipeline does what megatron's serial path does, per chunk
            assert piped["pipeline_dispatches"] == 2 * serial["api_dispatches"], (line, mode)
            assert piped["api_dispatches"] == piped["pipeline_dispatches"], piped
            for key, (diff, scale) in res[(mode, "diffs")].items():
                assert diff <= ULPS * EPS32 * scale, (line, mode, key, diff)
            # after the pipeline the manager holds no handle, ids or probabilities of the
            # received tokens (nothing reads them after the combine, on any line)
            assert res[(mode, 2, "kept")] == (True, True, True), (line, mode)


# ------------------------------------------------------- the inference dispatcher switch (0.18+)
class _Recorder:
    """Stands in for megatron's forward: records the dispatcher each call saw."""

    def __init__(self) -> None:
        self.seen: list = []

    def __call__(self, layer, hidden_states, intermediate_tensors=None, padding_mask=None):
        self.seen.append(layer.token_dispatcher)
        return hidden_states, None


def _fake_layer(**config) -> SimpleNamespace:
    base = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                sequence_parallel=False, moe_shared_expert_overlap=False)  # fmt: skip
    return SimpleNamespace(
        config=SimpleNamespace(**{**base, **config}), training=True,
        fwd_execution_map=["route", "expert_compute", "postprocess"],
        attn_tp_group=SimpleNamespace(size=lambda: 1), token_dispatcher="training",
    )  # fmt: skip


@pytest.fixture
def inference_mode(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A stand-in for ``megatron.core.inference.utils.InferenceMode`` (0.18+): set ``.active``."""
    flag = SimpleNamespace(active=False)
    utils = ModuleType("megatron.core.inference.utils")
    utils.InferenceMode = SimpleNamespace(is_active=lambda: flag.active)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.inference.utils", utils)
    monkeypatch.setenv("TITAN_MOE_EP_OVERLAP_CHUNKS", "1")  # megatron's path: no pipeline to run
    stats.reset()
    upstream_paths.reset()
    yield flag
    stats.reset()


@pytest.mark.parametrize("line", sorted(moe_forward.RULES))
def test_inference_calls_go_to_megatron_where_it_switches_dispatchers(inference_mode, line) -> None:
    original = _Recorder()
    forward = moe_forward.make_forward(original, line)
    layer = _fake_layer()
    layer._inference_token_dispatcher, layer._training_token_dispatcher = "inference", "training"
    layer.token_dispatcher = "inference"  # left by an earlier call under InferenceMode
    inference_mode.active = True
    forward(layer, torch.zeros(2, 1, 4))
    switches = moe_forward.RULES[line].inference_dispatcher
    counts = stats.counts()
    assert (counts["upstream_calls"], counts["serial_calls"]) == ((1, 0) if switches else (0, 1))
    assert original.seen == ["inference"]  # megatron's forward makes the switch itself
    inference_mode.active = False
    forward(layer, torch.zeros(2, 1, 4))
    # outside InferenceMode megatron's 0.18+ forward puts its training dispatcher back first;
    # so does the plugin's before its own path (here: the serial one, CHUNKS=1)
    assert original.seen[-1] == ("training" if switches else "inference"), (line, original.seen)


def test_without_an_inference_dispatcher_inference_mode_changes_nothing(inference_mode) -> None:
    original = _Recorder()
    forward = moe_forward.make_forward(original, "0.19")
    inference_mode.active = True
    forward(_fake_layer(), torch.zeros(2, 1, 4))
    assert stats.counts()["serial_calls"] == 1 and stats.counts()["upstream_calls"] == 0


def test_each_variant_s_signature_holds_only_on_the_code_of_its_line() -> None:
    """The installed megatron-core matches its own line's MoELayer.forward record and no other:
    a variant that met another line's forward (a fork, a mislabelled version) is skipped with
    what differs, instead of pipelining under rules that line does not follow."""
    import importlib

    from megatron.core import package_info
    from titan_moe_ep_overlap.patches import MOE_FORWARD

    from titan_plugins.patching import signature

    module = importlib.import_module("megatron.core.transformer.moe.moe_layer")
    line = f"{package_info.MAJOR}.{package_info.MINOR}"
    verdicts = {
        v: signature.check_all(s, module, "MoELayer.forward") for v, s in MOE_FORWARD.items()
    }
    assert verdicts.pop(line) is None, (line, verdicts)
    assert all(verdicts.values()), (line, verdicts)  # every other variant names a difference
