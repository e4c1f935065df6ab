"""Platform layer: device / backend selection and capability probes, with faked modules."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from titan_plugins import platform
from titan_plugins.testing import fake_module

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


@pytest.fixture
def musa(monkeypatch):
    """A fake torch.musa (what torch_musa registers) that reports an available device."""

    class Stream:
        pass

    class Event:
        pass

    fake = types.SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 3,
        Stream=Stream,
        Event=Event,
        current_stream=lambda: "musa-current",
        stream=lambda s: ("musa-stream-ctx", s),
    )
    monkeypatch.setattr(torch, "musa", fake, raising=False)
    return fake


def test_cpu_defaults():
    assert platform.device_type() == "cpu"
    assert platform.collective_backend() == "gloo"
    assert platform.current_device() == torch.device("cpu")
    stream, event = platform.new_stream(), platform.new_event()
    assert isinstance(stream, platform.NoopStream) and event.query() is True
    with platform.stream_context(stream):
        pass
    assert platform.pin_memory_supported() is False


def test_musa_is_detected_first(musa, monkeypatch):
    assert platform.device_type() == "musa"
    assert platform.collective_backend() == "mccl"
    # "musa" is a valid torch.device type only once torch_musa registered it
    monkeypatch.setattr(torch, "device", lambda kind, index=None: (kind, index))
    assert platform.current_device() == ("musa", 3)
    assert isinstance(platform.new_stream(), musa.Stream)
    assert isinstance(platform.new_event(), musa.Event)
    assert platform.stream_context("s") == ("musa-stream-ctx", "s")
    assert platform.pin_memory_supported() is True


def test_a_device_module_answering_a_device_is_taken_as_is(monkeypatch):
    # the verify worker: is_available() True, current_device() the CPU device megatron uses
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    assert platform.device_type() == "cuda"
    assert platform.current_device() == torch.device("cpu")  # TypeError before
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # a real GPU's index
    assert platform.current_device() == torch.device("cuda", 1)


def test_cuda_backend_name():
    assert platform.collective_backend("cuda") == "nccl"


def test_probe_deep_ep_absent(monkeypatch):
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    probe = platform.probe_deep_ep()
    assert not probe.available and "not installed" in probe.detail and probe.fix


def test_probe_deep_ep_v1_and_v2(monkeypatch):
    class Buffer:
        def get_dispatch_layout(self):
            pass

        def dispatch(self):
            pass

    fake_module("deep_ep", Buffer=Buffer, __version__="1.2.1")
    fake_module("deep_ep.utils", EventOverlap=object, EventHandle=object)
    try:
        assert platform.probe_deep_ep().available
        fake_module("deep_ep.utils", EventHandle=object)  # v2: no EventOverlap
        sys.modules["deep_ep"].__version__ = "2.1.0"
        probe = platform.probe_deep_ep()
        assert not probe.available and "v2" in probe.detail and "v1" in probe.fix
    finally:
        sys.modules.pop("deep_ep", None)
        sys.modules.pop("deep_ep.utils", None)


def test_probe_te_meta_package_that_raises(monkeypatch):
    fake_module("transformer_engine")

    def boom(name, *a, **k):
        raise RuntimeError("Found empty `transformer-engine` meta package installed")

    monkeypatch.setattr(platform.importlib, "import_module", boom)
    try:
        probe = platform.probe_te_blockwise()
        assert not probe.available and "meta package" in probe.detail
    finally:
        sys.modules.pop("transformer_engine", None)


def test_probe_mooncake_reports_missing_ibverbs(monkeypatch):
    fake_module("mooncake")
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)

    def boom(name, *a, **k):
        raise ImportError("libibverbs.so.1: cannot open shared object file")

    monkeypatch.setattr(platform.importlib, "import_module", boom)
    try:
        probe = platform.probe_mooncake()
        assert not probe.available and probe.fix == "apt-get install libibverbs1"
    finally:
        sys.modules.pop("mooncake", None)
