"""Backend choice, shape validation and knobs (in-process; megatron is not imported)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from titan_fp8_blockwise import backend, settings
from titan_fp8_blockwise.patches import _wrap_get_fp8_context

from titan_plugins import platform
from titan_plugins.settings import SettingError

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in [s.name for s in settings.SETTINGS] + ["TITAN_PLUGINS_STRICT"]:
        monkeypatch.delenv(var, raising=False)
    backend.reset()
    yield
    backend.reset()


def _config(**fields) -> SimpleNamespace:
    base = dict(
        fp8="e4m3",
        fp8_recipe="blockwise",
        hidden_size=256,
        ffn_hidden_size=512,
        num_attention_heads=4,
        kv_channels=64,
        num_moe_experts=None,
        tensor_model_parallel_size=1,
    )
    return SimpleNamespace(**{**base, **fields})


def _te(available: bool, monkeypatch) -> None:
    probe = platform.Probe(available, "fake TE probe", "install TE")
    monkeypatch.setattr(platform, "probe_te_blockwise", lambda: probe)


def test_fp8_backend_te_requested_but_absent_warns_and_falls_back(monkeypatch, caplog):
    _te(False, monkeypatch)
    monkeypatch.setenv(settings.BACKEND.name, "te")
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        assert backend.resolve_backend() == "torch"
    assert "fake TE probe" in caplog.text and "pure-torch" in caplog.text
    assert backend.recipe_for(_config()) is not None  # the plugin serves it


def test_fp8_backend_te_requested_but_absent_is_an_error_under_strict(monkeypatch):
    _te(False, monkeypatch)
    monkeypatch.setenv(settings.BACKEND.name, "te")
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="TITAN_FP8_BLOCKWISE_BACKEND=te"):
        backend.resolve_backend()


def test_fp8_backend_te_present_leaves_megatron_its_own_path(monkeypatch):
    _te(True, monkeypatch)
    assert backend.resolve_backend() == "te"
    cfg = _config()
    assert backend.recipe_for(cfg) is None

    def original(config, layer_no=-1, is_init=False):
        return ("megatron", layer_no, is_init)

    assert _wrap_get_fp8_context(original)(cfg, 3) == ("megatron", 3, False)


def test_fp8_backend_torch_choice_ignores_te(monkeypatch):
    _te(True, monkeypatch)
    monkeypatch.setenv(settings.BACKEND.name, "torch")
    assert backend.resolve_backend() == "torch"


def test_fp8_backend_other_recipes_are_not_served(monkeypatch):
    _te(False, monkeypatch)
    assert backend.recipe_for(_config(fp8_recipe="delayed")) is None
    assert backend.recipe_for(_config(fp8=None)) is None


def test_fp8_backend_recipe_follows_format_and_scale_knob(monkeypatch):
    _te(False, monkeypatch)
    monkeypatch.setenv(settings.SCALES.name, "deepseek")
    recipe = backend.recipe_for(_config(fp8="hybrid"))
    assert recipe.bwd_dtype == torch.float8_e5m2 and recipe.fwd_dtype == torch.float8_e4m3fn
    assert recipe.scales == "deepseek"


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"hidden_size": 100}, "hidden_size = 100"),
        (
            {"ffn_hidden_size": 96, "tensor_model_parallel_size": 4},
            "ffn_hidden_size / tensor_model_parallel_size (4) = 24",
        ),
        (
            {"num_moe_experts": 8, "moe_ffn_hidden_size": 40},
            "moe_ffn_hidden_size / expert_tensor_parallel_size (1) = 40",
        ),
    ],
)
def test_fp8_backend_shape_the_blocks_cannot_serve(monkeypatch, fields, named):
    _te(False, monkeypatch)
    with pytest.raises(ValueError, match="multiple of 16") as err:
        backend.recipe_for(_config(**fields))
    assert named in str(err.value)


def test_fp8_backend_high_precision_knob(monkeypatch, caplog):
    monkeypatch.setenv(settings.HIGH_PRECISION.name, "router, norms")
    assert settings.high_precision() == {"router", "embedding", "norms"}  # embedding: always
    monkeypatch.setenv(settings.HIGH_PRECISION.name, "router, bogus")
    with caplog.at_level(logging.WARNING, logger="titan_plugins"):
        parts = settings.high_precision()
    assert parts == set(settings.HIGH_PRECISION_PARTS)  # a bad value: warned, default used
    assert "bogus" in caplog.text and "output_head" in caplog.text  # names what is accepted
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="output_head"):
        settings.high_precision()


def test_fp8_backend_configure_hook_force_and_validation(monkeypatch):
    from titan_fp8_blockwise import plugin

    _te(False, monkeypatch)
    cfg = _config(fp8=None, fp8_recipe="delayed")
    plugin.titan_configure(cfg)  # FORCE off: untouched
    assert (cfg.fp8, cfg.fp8_recipe) == (None, "delayed")
    monkeypatch.setenv(settings.FORCE.name, "1")
    cfg = _config(fp8=None, fp8_recipe="delayed")
    plugin.titan_configure(cfg)
    assert (cfg.fp8, cfg.fp8_recipe) == ("e4m3", "blockwise")
    with pytest.raises(ValueError, match="hidden_size = 100"):
        plugin.titan_configure(_config(fp8=None, hidden_size=100))
    report = plugin.titan_report()
    assert report["backend"] == "torch" and report["force"] is True


def test_fp8_backend_te_general_gemm_fix():
    from titan_fp8_blockwise.replacements import te_general_gemm

    from titan_plugins.patching import MISSING

    assert te_general_gemm(MISSING) is None  # 0.16.1 without TE: megatron's torch path

    def gemm():
        return None

    assert te_general_gemm(gemm) is gemm  # TE present: untouched


def test_fp8_backend_plugin_import_is_cheap_and_megatron_free():
    import subprocess
    import sys

    # What runs while megatron imports: the entry point, the settings, the patch records. The
    # FP8 machinery (quantizer, GEMM, linear, SwiGLU store, weight cache) loads at first use.
    code = (
        "import sys, titan_fp8_blockwise.plugin as p, titan_fp8_blockwise.patches as m\n"
        "p.titan_settings()\n"
        "assert len(m.patches()) >= 10\n"
        "assert not [n for n in sys.modules if n.startswith('megatron')], 'megatron imported'\n"
        "heavy = ('quantize', 'gemm', 'linear', 'recipe', 'swiglu_store', 'weight_cache')\n"
        "loaded = [h for h in heavy if 'titan_fp8_blockwise.' + h in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
