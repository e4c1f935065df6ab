"""Backend choice and megatron wiring: fake DeepEP builds (v2, MT-DeepEP, a compatible v1), STRICT,
bad settings, and the patches applied / undone on real megatron-core in a gloo worker."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest
import torch
from titan_moe_ep_overlap import bindings, doctor, plugin, selection
from titan_moe_ep_overlap.overlap import chunk_bounds

from titan_plugins.settings import SettingError


def _fake_deep_ep(kind: str) -> dict[str, types.ModuleType]:
    """A fake ``deep_ep`` package: "v1" (compatible), "v2" (utils lacks EventOverlap), "mt"."""
    deep_ep = types.ModuleType("deep_ep")
    deep_ep.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None, is_package=True)
    utils = types.ModuleType("deep_ep.utils")
    utils.__spec__ = importlib.machinery.ModuleSpec("deep_ep.utils", None)

    class EventHandle:
        pass

    utils.EventHandle = EventHandle
    if kind != "v2":
        utils.EventOverlap = type("EventOverlap", (), {})
    size_arg = "num_mtl_bytes" if kind == "mt" else "num_nvl_bytes"
    namespace: dict = {}
    exec(f"def __init__(self, group, {size_arg}=0, num_rdma_bytes=0): pass", namespace)
    methods = ("get_dispatch_layout", "dispatch", "combine", "get_dispatch_config",
               "get_combine_config", "set_num_sms")  # fmt: skip
    body = {name: staticmethod(lambda *a, **k: None) for name in methods}
    deep_ep.Buffer = type("Buffer", (), {"__init__": namespace["__init__"], **body})
    deep_ep.utils = utils
    deep_ep.__version__ = "2.1.0" if kind == "v2" else "1.2.1"
    return {"deep_ep": deep_ep, "deep_ep.utils": utils}


@pytest.fixture
def fresh_selection(monkeypatch):
    monkeypatch.delenv("TITAN_PLUGINS_STRICT", raising=False)
    monkeypatch.delenv("TITAN_MOE_EP_OVERLAP_BACKEND", raising=False)
    selection.reset()
    yield monkeypatch
    selection.reset()


def _install(monkeypatch, kind: str) -> None:
    for name, module in _fake_deep_ep(kind).items():
        monkeypatch.setitem(sys.modules, name, module)


def test_deep_ep_v2_falls_back_with_a_clear_message(fresh_selection, caplog) -> None:
    _install(fresh_selection, "v2")
    with caplog.at_level(logging.WARNING):
        chosen = selection.select_backend()
    assert chosen.backend == selection.TORCH
    assert "EventOverlap" in chosen.detail
    assert "install DeepEP v1.x" in caplog.text and "EventOverlap" in caplog.text
    check = doctor.check_deep_ep()
    assert check.status == "warn" and "DeepEP v2 detected" in check.detail and check.fix
    assert chosen.api.Buffer.__module__ == "titan_moe_ep_overlap.buffer"


def test_deep_ep_v2_is_an_error_under_strict(fresh_selection) -> None:
    _install(fresh_selection, "v2")
    fresh_selection.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="EventOverlap"):
        selection.select_backend()
    assert plugin.titan_report()["backend"] == "error"


def test_mt_deep_ep_signature_is_rejected(fresh_selection, caplog) -> None:
    _install(fresh_selection, "mt")
    with caplog.at_level(logging.WARNING):
        chosen = selection.select_backend()
    assert chosen.backend == selection.TORCH and "num_mtl_bytes" in chosen.detail


def test_compatible_deep_ep_is_used_and_megatron_keeps_it(fresh_selection) -> None:
    from titan_moe_ep_overlap.patches import _backend_value

    from titan_plugins.patching import MISSING

    _install(fresh_selection, "v1")
    chosen = selection.select_backend()
    assert chosen.backend == selection.DEEP_EP and chosen.api is sys.modules["deep_ep"]
    original = sys.modules["deep_ep"].Buffer
    assert _backend_value("Buffer")(original) is original
    assert (
        bindings.real(_backend_value("Buffer")(MISSING)).__module__ == "titan_moe_ep_overlap.buffer"
    )
    assert plugin.titan_moe_dispatcher(config=None) is sys.modules["deep_ep"]
    assert doctor.check_deep_ep().status == "ok"


def test_forcing_deep_ep_without_it(fresh_selection, caplog) -> None:
    fresh_selection.setenv("TITAN_MOE_EP_OVERLAP_BACKEND", "deep_ep")
    with caplog.at_level(logging.WARNING):
        assert selection.select_backend().backend == selection.TORCH
    assert "not installed" in caplog.text
    selection.reset()
    fresh_selection.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="TITAN_MOE_EP_OVERLAP_BACKEND=torch"):
        selection.select_backend()


def test_bad_settings_and_expert_count(fresh_selection, caplog) -> None:
    from titan_moe_ep_overlap import settings

    fresh_selection.setenv("TITAN_MOE_EP_OVERLAP_CHUNKS", "0")
    with caplog.at_level(logging.WARNING):
        assert settings.CHUNKS.read() == settings.CHUNKS.default
    config = types.SimpleNamespace(num_moe_experts=6, expert_model_parallel_size=4)
    with caplog.at_level(logging.WARNING):
        plugin.titan_configure(config=config)
    assert "num_moe_experts=6" in caplog.text and "--num-experts" in caplog.text
    fresh_selection.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="divisible"):
        plugin.titan_configure(config=config)


def test_chunk_bounds_cover_tokens_with_a_fixed_count() -> None:
    for tokens in (0, 1, 3, 10, 17):
        bounds = chunk_bounds(tokens, 4)
        assert len(bounds) == 4 and bounds[0][0] == 0 and bounds[-1][1] == tokens
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) - min(sizes) <= 1


def task_wiring_with_fake_v2(strict: str) -> dict:
    """Real megatron: with a DeepEP v2 build importable, the flex dispatcher runs on our backend;
    under STRICT the activation fails; on exit megatron's names are restored."""
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=2)
    fakes = _fake_deep_ep("v2")
    sys.modules.update(fakes)
    result: dict = {}
    try:
        with plugin_active("moe_ep_overlap", env={"TITAN_PLUGINS_STRICT": strict}) as engine:
            result["status"] = {
                p.id: p.status for p in engine.patches() if p.id.startswith("moe_ep_overlap.")
            }
            result["buffer"] = bindings.real(fused_a2a.Buffer).__module__
            result["flag"] = fused_a2a.HAVE_DEEP_EP
            from titan_moe_ep_overlap.moe_forward import chunked_experts  # noqa: F401

            cfg = tiny_gpt.make_config(num_layers=1, moe_token_dispatcher_type="flex",
                                       moe_router_dtype="fp32")  # fmt: skip
            layer = tiny_gpt.build_model(cfg, ddp=False)[0].decoder.layers[0].mlp
            x = torch.randn(4, 2, 64, requires_grad=True)
            out, _ = layer(x)
            out.sum().backward()
            result["finite"] = bool(torch.isfinite(x.grad).all())
    except Exception as err:  # STRICT: the activation itself must fail, clearly
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        for name in fakes:
            sys.modules.pop(name, None)
        selection.reset()
    result["restored"] = (
        token_dispatcher.fused_dispatch is None
        and not hasattr(fused_a2a, "Buffer")
        and fused_a2a.HAVE_DEEP_EP is False
    )
    return result


@pytest.mark.multiprocess
def test_megatron_wiring_with_incompatible_deep_ep(gloo_pool2) -> None:
    for res in gloo_pool2.run(task_wiring_with_fake_v2, "0"):
        assert "error" not in res, res
        # one MoELayer.forward record per Megatron line: this line's applies, the others are
        # "other line" (test_moe_ep_overlap_lines checks which); every other record applies
        forward = [v for k, v in res["status"].items() if ".moe_layer_forward" in k]
        assert sorted(forward) == ["applied"] + ["other line"] * 3, res["status"]
        others = [v for k, v in res["status"].items() if ".moe_layer_forward" not in k]
        assert len(others) == 11 and set(others) == {"applied"}, res["status"]
        assert res["buffer"] == "titan_moe_ep_overlap.buffer" and res["finite"]
        assert res["flag"] is True
        assert res["restored"]
    for res in gloo_pool2.run(task_wiring_with_fake_v2, "1"):
        assert "EventOverlap" in res.get("error", ""), res
        assert res["restored"]


def test_config_and_static_buffer_api() -> None:
    """DeepEP's Config checks and size hints; Buffer's static API and refusals name the fix."""
    from titan_moe_ep_overlap.buffer import Buffer
    from titan_moe_ep_overlap.deepep_config import Config

    with pytest.raises(AssertionError):
        Config(20, 256, 256)  # nvl send chunk must be smaller than the recv chunk
    with pytest.raises(AssertionError):
        Config(20, 6, 256, 80, 128)  # rdma send > recv / 2
    assert Config(20, 6, 256, 6, 100).num_max_rdma_chunked_recv_tokens == 102  # rounded up
    config = Buffer.get_dispatch_config(8)
    assert config.get_rdma_buffer_size_hint(1024, 8) == 0  # one NVLink domain: no RDMA buffer
    assert config.get_rdma_buffer_size_hint(1024, 16) > 0
    assert config.get_nvl_buffer_size_hint(2048, 8) > config.get_nvl_buffer_size_hint(1024, 8)
    saved = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        assert Buffer.get_combine_config(4).num_sms == 24
        with pytest.raises(AssertionError, match="even"):
            Buffer.set_num_sms(7)
    finally:
        Buffer.num_sms = saved
    assert Buffer.capture().event is not None and not Buffer.is_sm90_compiled()
    with pytest.raises(ValueError, match="process group"):
        Buffer(None)


def _flex_layer(backend: str) -> object:
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    cfg = tiny_gpt.make_config(num_layers=1, moe_token_dispatcher_type="flex",
                               moe_router_dtype="fp32", moe_flex_dispatcher_backend=backend)  # fmt: skip
    return tiny_gpt.build_model(cfg, ddp=False)[0].decoder.layers[0].mlp


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def task_megatron_capability_flags() -> dict:
    """What megatron's own flags and checks say about DeepEP / HybridEP with the plugin off, on
    (torch backend) and off again, and what megatron's own constructors do with them."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import fused_a2a

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(ep=2)
    out: dict = {"off": (fused_a2a.HAVE_DEEP_EP, fused_a2a.HAVE_HYBRIDEP)}
    out["off_deepep"] = _error(lambda: _flex_layer("deepep"))
    with plugin_active("moe_ep_overlap", env={"TITAN_MOE_EP_OVERLAP_BACKEND": "torch"}):
        out["on"] = (fused_a2a.HAVE_DEEP_EP, fused_a2a.HAVE_HYBRIDEP)
        out["on_deepep"] = type(_flex_layer("deepep").token_dispatcher._comm_manager).__name__
        out["on_hybridep"] = _error(lambda: _flex_layer("hybridep"))
        out["low_latency"] = _error(
            lambda: fused_a2a.Buffer(dist.group.WORLD, 0, 0, low_latency_mode=True)
        )
        out["report_flag"] = plugin.titan_report()["megatron_HAVE_DEEP_EP"]
    out["after"] = (fused_a2a.HAVE_DEEP_EP, fused_a2a.HAVE_HYBRIDEP)
    out["after_deepep"] = _error(lambda: _flex_layer("deepep"))
    return out


@pytest.mark.multiprocess
def test_megatron_sees_the_backend_and_nothing_more(gloo_pool2) -> None:
    """HAVE_DEEP_EP is True exactly while the plugin's backend is bound; without it megatron
    refuses the deepep backend with its own message. HybridEP and DeepEP's low-latency mode are
    not provided: HAVE_HYBRIDEP stays False and megatron's own HybridEP message is raised."""
    for res in gloo_pool2.run(task_megatron_capability_flags):
        deepep_refusal = "ImportError: DeepEP is not installed"
        assert res["off"] == res["after"] == (False, False), res
        assert res["off_deepep"].startswith(deepep_refusal), res
        assert res["after_deepep"].startswith(deepep_refusal), res
        assert res["on"] == (True, False) and res["report_flag"] is True, res
        assert res["on_deepep"] == "_DeepepManager", res
        assert res["on_hybridep"].startswith("ImportError: HybridEP is not installed"), res
        assert res["low_latency"].startswith("NotImplementedError: moe_ep_overlap: low-latency")


def test_flag_follows_the_binding() -> None:
    """The HAVE_DEEP_EP factory: megatron's True is kept (a real DeepEP was imported); False
    turns True only when fused_a2a really holds our Buffer and entry points."""
    from titan_moe_ep_overlap import patches

    fake = types.ModuleType(patches.FUSED_A2A)
    sys.modules[patches.FUSED_A2A], saved = fake, sys.modules.get(patches.FUSED_A2A)
    try:
        assert patches._have_deep_ep(True) is True
        assert patches._have_deep_ep(False) is False  # nothing bound
        fake.Buffer = bindings.Buffer
        for name, entry in bindings.ENTRY_POINTS.items():
            setattr(fake, name, entry)
        assert patches._have_deep_ep(False) is True
        fake.fused_combine = None  # one entry point missing: the path would fail
        assert patches._have_deep_ep(False) is False
    finally:
        if saved is None:
            sys.modules.pop(patches.FUSED_A2A, None)
        else:
            sys.modules[patches.FUSED_A2A] = saved


HEAVY = ("buffer", "dispatch_ops", "comm", "layout", "rowpack", "overlap", "moe_forward",
         "autochunk", "events", "selection", "stats")  # fmt: skip
_PROBE = """
import sys, json
import megatron.core
from megatron.core.transformer.moe import fused_a2a
print(json.dumps({"loaded": sorted(m for m in sys.modules if m.startswith("titan_moe_ep_overlap")),
                  "flag": fused_a2a.HAVE_DEEP_EP, "buffer": repr(fused_a2a.Buffer)}))
"""


def test_megatron_import_loads_no_backend_and_sees_the_flag() -> None:
    """The real automatic channel in a fresh process: after ``import megatron.core`` (which
    executes fused_a2a and moe_layer, so every patch is applied) megatron's flag is True and
    none of the backend or pipeline modules was imported (issue 17: activation cost)."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    env.update(TITAN_PLUGINS_ONLY="moe_ep_overlap", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["flag"] is True and "titan_moe_ep_overlap.bindings.Buffer" in probe["buffer"], (
        probe
    )
    assert not [m for m in probe["loaded"] if m.rsplit(".", 1)[-1] in HEAVY], probe["loaded"]


def test_deep_ep_lookup_follows_the_path(tmp_path, monkeypatch) -> None:
    """The found / not found answer is kept per sys.path, so a path that gains a deep_ep sees it."""
    from titan_moe_ep_overlap import patches

    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    # a path of our own, so the answer does not depend on whether this host has DeepEP
    empty, with_it = tmp_path / "empty", tmp_path / "with"
    empty.mkdir()
    (with_it / "deep_ep").mkdir(parents=True)
    (with_it / "deep_ep" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(empty)])
    assert patches.deep_ep_installed() is False
    monkeypatch.setattr(sys, "path", [str(with_it), str(empty)])
    assert patches.deep_ep_installed() is True
    assert "deep_ep" not in sys.modules  # found, not imported
