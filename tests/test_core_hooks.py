"""Every hook is documented and exercised (through the example plugin and the core's wiring)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest

from titan_plugins import activation, hookimpl, hookspecs
from titan_plugins.hosts.megatron.patches import _wrap_add_arguments, _wrap_config_from_args
from titan_plugins.patching import PatchEngine
from titan_plugins.settings import Setting
from titan_plugins.testing import fake_entry_point

HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("titan_"))
EXAMPLE_DIR = Path(__file__).parent / "example_plugin"


@pytest.fixture
def example(monkeypatch):
    """The example plugin registered in a fresh manager that is the active one."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    module = importlib.import_module("titan_example_plugin")
    ep = fake_entry_point("example", "titan_example_plugin", "titan-example-plugin")
    state = activation.Activation("test", entry_points=[ep]).start()
    with activation.use(state):
        yield state.manager, module
    state.stop()
    module.SEEN_CONFIGS.clear()


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_is_documented(name):
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec) or ""
    assert len(doc.splitlines()) >= 3, f"{name} needs a real docstring"
    assert ":return:" in doc, f"{name} must say what it returns"
    opts = spec.titan_spec
    if opts.get("historic"):
        assert "Historic" in doc
    if opts.get("firstresult"):
        assert "Firstresult" in doc


def test_every_hook_has_a_test():
    here = sys.modules[__name__]
    missing = [h for h in HOOKS if not hasattr(here, f"test_hook_{h}")]
    assert not missing, f"hooks without a test: {missing}"


def test_hook_titan_register_patches(example):
    pm, _ = example
    engine = PatchEngine()
    errors: list[str] = []
    activation.register_patches(pm, engine, errors)
    (patch,) = [p for p in engine.patches() if p.plugin == "example"]
    assert patch.plugin == "example" and patch.target.endswith(":initialize_model_parallel")
    assert not errors


def test_hook_titan_settings(example):
    pm, _ = example
    (settings,) = [
        impl.function()
        for impl in pm.hook.titan_settings.get_hookimpls()
        if impl.plugin_name == "example"
    ]
    assert settings and all(isinstance(s, Setting) for s in settings)


def test_hook_titan_add_arguments(example):
    pm, _ = example

    def add_megatron_arguments(parser):
        parser.add_argument("--num-layers", type=int)
        return parser

    wrapped = _wrap_add_arguments(add_megatron_arguments)
    parser = argparse.ArgumentParser()
    wrapped(parser)
    args = parser.parse_args(["--num-layers", "2", "--titan-example-flag", "5"])
    assert (args.num_layers, args.titan_example_flag) == (2, 5)


def test_hook_titan_configure(example):
    _, module = example
    config = types.SimpleNamespace(num_layers=2)
    wrapped = _wrap_config_from_args(lambda args, config_class=None: config)
    assert wrapped(object()) is config
    assert module.SEEN_CONFIGS[-1] is config


def test_hook_titan_moe_dispatcher(example):
    pm, _ = example
    assert pm.hook.titan_moe_dispatcher(config=types.SimpleNamespace()) is None
    chosen = pm.hook.titan_moe_dispatcher(config=types.SimpleNamespace(example_backend=True))
    assert chosen == "example-dispatcher"  # firstresult: a value, not a list


def test_hook_titan_p2p_communicator(example):
    pm, _ = example
    assert (
        pm.hook.titan_p2p_communicator(config=types.SimpleNamespace(example_backend=True))
        == "example-p2p"
    )


def test_hook_titan_report(example, monkeypatch):
    pm, _ = example
    monkeypatch.setenv("TITAN_EXAMPLE_GREETING", "hi")
    assert pm.hook.titan_report() == [{"greeting": "hi", "calls": 0}]


def test_hook_titan_effects(example):
    pm, module = example
    module.CALLS.clear()
    assert pm.hook.titan_effects() == [{"initialize_model_parallel_calls": 0}]
    module.CALLS.append("initialize_model_parallel")
    assert pm.hook.titan_effects() == [{"initialize_model_parallel_calls": 1}]
    module.CALLS.clear()


def test_hook_titan_memory_effect(example):
    from titan_plugins.plan.effects import MemoryEffect, MemoryLayout
    from titan_plugins.plan.flags import parse_flags
    from titan_plugins.plan.from_flags import build_config
    from titan_plugins.plan.memory import stage_memory

    pm, _ = example
    effect = MemoryEffect(
        "answer", "ans", "nothing kept", "TITAN_ANSWER=1", stored_bytes=lambda t, b: 0.0
    )

    class Answer:
        @hookimpl
        def titan_memory_effect(self, layout):
            return effect if layout.config.pp > 1 else None  # None: no effect on this layout

    pm.register(Answer(), name="answer")
    flags = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16".split()
    flags += ["--vocab-size", "128"]
    single = build_config(parse_flags(flags), 1)
    pipelined = build_config(parse_flags([*flags, "--pipeline-model-parallel-size", "2"]), 2)
    assert pm.hook.titan_memory_effect(layout=MemoryLayout(pipelined)) == [effect]
    assert pm.hook.titan_memory_effect(layout=MemoryLayout(single)) == []
    stage = stage_memory(pipelined, effects=[effect])[0]
    assert stage.activations["configured"] > 0 and stage.activations["answer"] == 0


def test_hook_titan_doctor(example):
    pm, _ = example
    (checks,) = pm.hook.titan_doctor()
    assert checks[0].status == "ok"


# ---------------------------------------------------------------------------- training-loop hooks
class StepRecorder:
    """A plugin wrapping every training-loop hook; records what each one saw."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @hookimpl(wrapper=True)
    def titan_train_step(self, step):
        self.events.append(("step", step.schedule, step.index, step.forward_only, len(step.model)))
        result = yield
        self.events.append(("step-done", step.index, len(result)))
        return result

    @hookimpl(wrapper=True)
    def titan_forward_microbatch(self, call):
        self.events.append(("fwd", call.step.index, call.vp_stage, call.input_tensor is None))
        return (yield)

    @hookimpl(wrapper=True)
    def titan_backward_microbatch(self, call):
        self.events.append(("bwd", call.step.index, call.output_tensor is not None))
        return (yield)

    @hookimpl(wrapper=True)
    def titan_optimizer_step(self, step):
        success, grad_norm, zeros = yield
        self.events.append(("opt", step.step.index, type(step.optimizer).__name__, success))
        return success, grad_norm, zeros


def hooked_training(parallel: dict) -> dict:
    """Train 2 steps and evaluate once with and without a recorder wrapping every hook."""
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    out: dict = {}
    for mode in ("plain", "hooked"):
        tiny_gpt.init_parallel(**parallel)
        vpp = parallel.get("vpp") or 1
        cfg = tiny_gpt.make_config(num_layers=2 * vpp * parallel.get("pp", 1))
        chunks = tiny_gpt.build_model(cfg)
        recorder = StepRecorder()
        state = activation.Activation("test.hooks", entry_points=[]).start()
        if mode == "hooked":
            state.manager.register(recorder, name="recorder")
        with activation.use(state):
            losses, norms = tiny_gpt.train(chunks, cfg, 2, num_microbatches=4)
            evaluated = tiny_gpt.evaluate(chunks, cfg, num_microbatches=4)
        state.stop()
        out[mode] = {"losses": losses, "norms": norms, "eval": evaluated}
        out["events"] = recorder.events
    return out


@pytest.fixture(scope="module")
def hooked_pp2(gloo_pool2):
    return gloo_pool2.run(hooked_training, {"pp": 2})


@pytest.fixture(scope="module")
def hooked_vpp(gloo_pool2):
    return gloo_pool2.run(hooked_training, {"pp": 2, "vpp": 2})


def test_hooks_leave_training_bit_identical(hooked_pp2, hooked_vpp):
    for rank_result in hooked_pp2 + hooked_vpp:
        assert rank_result["hooked"] == rank_result["plain"]
    assert hooked_pp2[1]["plain"]["losses"]  # the last stage reports losses


def test_hook_titan_train_step(hooked_pp2, hooked_vpp):
    for results, schedule, chunks in ((hooked_pp2, "1f1b", 1), (hooked_vpp, "interleaved", 2)):
        for rank, result in enumerate(results):
            steps = [e for e in result["events"] if e[0] == "step"]
            assert steps == [
                ("step", schedule, 0, False, chunks),
                ("step", schedule, 1, False, chunks),
                ("step", schedule, 2, True, chunks),  # evaluation carries the next index
            ]
            done = [e for e in result["events"] if e[0] == "step-done"]
            per_step = 4 if rank == 1 else 0  # the schedule's loss reports: last stage only
            assert done == [("step-done", i, per_step) for i in range(3)]


def test_hook_titan_forward_microbatch(hooked_pp2, hooked_vpp):
    for results, chunks in ((hooked_pp2, 1), (hooked_vpp, 2)):
        for rank, result in enumerate(results):
            forwards = [e for e in result["events"] if e[0] == "fwd"]
            assert len(forwards) == 3 * 4 * chunks  # 3 calls x 4 microbatches x chunks
            assert {e[1] for e in forwards} == {0, 1, 2}
            if chunks == 2:
                assert {e[2] for e in forwards} == {0, 1}
            # Only the very first virtual stage reads data instead of a received tensor.
            first_stage = [e for e in forwards if e[3]]
            assert len(first_stage) == (12 if rank == 0 else 0)


def test_hook_titan_backward_microbatch(hooked_pp2, hooked_vpp):
    for results, chunks in ((hooked_pp2, 1), (hooked_vpp, 2)):
        for result in results:
            backwards = [e for e in result["events"] if e[0] == "bwd"]
            assert backwards == [("bwd", i, True) for i in (0, 1) for _ in range(4 * chunks)]


def test_hook_titan_optimizer_step(hooked_pp2):
    for result in hooked_pp2:
        optimizer = [e for e in result["events"] if e[0] == "opt"]
        assert [(e[1], e[3]) for e in optimizer] == [(0, True), (1, True)]
        # The MoE model has dense and expert parameter groups: megatron chains two optimizers,
        # and only the outer step fires the hook.
        assert {e[2] for e in optimizer} == {"ChainedOptimizer"}
