"""Every hook is documented and exercised (through the example plugin and the core's wiring)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest

from titan_plugins import activation, hookspecs
from titan_plugins.builtin import _wrap_add_arguments, _wrap_config_from_args
from titan_plugins.manager import TitanPluginManager
from titan_plugins.patching import PatchEngine
from titan_plugins.settings import Setting

HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("titan_"))
EXAMPLE_DIR = Path(__file__).parent / "example_plugin"


@pytest.fixture
def example(monkeypatch):
    """The example plugin registered in a fresh manager that is the active one."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    module = importlib.import_module("titan_example_plugin")
    pm = TitanPluginManager()
    pm.add_hookspecs(hookspecs)
    pm.register(module, name="example")
    pm.check_pending()
    state = activation.Activation("test", manager=pm, engine=PatchEngine())
    monkeypatch.setattr(activation, "_ACTIVE", state)
    yield pm, module
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
    (patch,) = engine.patches()
    assert patch.plugin == "example" and patch.target.endswith(":initialize_model_parallel")
    assert not errors


def test_hook_titan_settings(example):
    pm, _ = example
    (settings,) = pm.hook.titan_settings()
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


def test_hook_titan_doctor(example):
    pm, _ = example
    (checks,) = pm.hook.titan_doctor()
    assert checks[0].status == "ok"
