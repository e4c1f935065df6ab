"""Platform layer: which device (musa / cuda / cpu), which collective backend, streams and
events that are real on GPUs and no-ops on CPU, and the capability probes plugins gate on.

MUSA is reached through torch_musa (``torch.musa``); torchada, when a host imported it, maps
``torch.cuda`` onto MUSA, so MUSA is checked first. Probes never raise: they return a
:class:`Probe` with the reason and the fix.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Probe:
    """Outcome of a capability probe."""

    available: bool
    detail: str
    fix: str = ""


def _torch() -> Any:
    import torch

    return torch


_TORCH_MUSA_INSTALLED: list[bool] = []  # find_spec costs ~20 us; streams/events are hot paths


def _musa_module() -> Any | None:
    torch = _torch()
    musa = getattr(torch, "musa", None)
    if musa is None and not _TORCH_MUSA_INSTALLED:
        _TORCH_MUSA_INSTALLED.append(importlib.util.find_spec("torch_musa") is not None)
    if musa is None and _TORCH_MUSA_INSTALLED[0]:
        try:
            importlib.import_module("torch_musa")  # registers torch.musa
        except Exception:
            return None
        musa = getattr(torch, "musa", None)
    return musa


def device_type() -> str:
    """``"musa"``, ``"cuda"`` or ``"cpu"``: the accelerator this process trains on."""
    musa = _musa_module()
    try:
        if musa is not None and musa.is_available():
            return "musa"
    except Exception:
        pass
    if _torch().cuda.is_available():
        return "cuda"
    return "cpu"


def collective_backend(device: str | None = None) -> str:
    """The torch.distributed backend for ``device``: mccl, nccl or gloo."""
    return {"musa": "mccl", "cuda": "nccl"}.get(device or device_type(), "gloo")


def device_module(device: str | None = None) -> Any | None:
    """``torch.musa`` / ``torch.cuda`` for accelerators, None on CPU."""
    kind = device or device_type()
    if kind == "musa":
        return _musa_module()
    if kind == "cuda":
        return _torch().cuda
    return None


def current_device() -> Any:
    """The ``torch.device`` this process computes on.

    The device module answers ``current_device()`` with an index; a CPU stand-in that looks
    like one GPU (``titan-plugins verify``'s upstream-test workers, where megatron passes the
    answer as ``device=``) answers with the ``torch.device`` itself, which is taken as is.
    """
    torch = _torch()
    module = device_module()
    if module is None:
        return torch.device("cpu")
    current = module.current_device()
    if not isinstance(current, int):
        return current
    return torch.device(device_type(), current)


class NoopEvent:
    """CPU stand-in for a device event: CPU work is already ordered."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record on CPU."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for on CPU."""

    def synchronize(self) -> None:
        """Nothing to synchronise on CPU."""

    def query(self) -> bool:
        """Always complete."""
        return True


class NoopStream:
    """CPU stand-in for a device stream."""

    def wait_stream(self, stream: Any) -> None:
        """CPU work is ordered; nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """CPU work is ordered; nothing to wait for."""

    def record_event(self, event: Any = None) -> NoopEvent:
        """Return a completed event."""
        return event if event is not None else NoopEvent()

    def synchronize(self) -> None:
        """Nothing to synchronise on CPU."""


_CPU_STREAM = NoopStream()


def new_stream() -> Any:
    """A side stream on the accelerator, or a no-op stream on CPU."""
    module = device_module()
    return module.Stream() if module is not None else NoopStream()


def current_stream() -> Any:
    """The current stream on the accelerator, or the shared no-op stream on CPU."""
    module = device_module()
    return module.current_stream() if module is not None else _CPU_STREAM


def stream_context(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """``with stream_context(s):`` runs on ``s`` on GPUs; a no-op on CPU."""
    module = device_module()
    if module is None or isinstance(stream, NoopStream):
        return contextlib.nullcontext()
    return module.stream(stream)


def new_event() -> Any:
    """A device event, or a completed no-op event on CPU."""
    module = device_module()
    return module.Event() if module is not None else NoopEvent()


def pin_memory_supported() -> bool:
    """Whether host buffers can be pinned (only with an accelerator)."""
    return device_module() is not None


def probe_deep_ep() -> Probe:
    """Is a DeepEP (v1 API: Buffer + deep_ep.utils.EventOverlap) importable and compatible?"""
    if importlib.util.find_spec("deep_ep") is None:
        return Probe(
            False, "deep_ep is not installed", "pip-install DeepEP v1.x (or MT-DeepEP on MUSA)"
        )
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as err:
        return Probe(
            False,
            f"import deep_ep failed: {type(err).__name__}: {err}",
            "rebuild DeepEP for this torch",
        )
    if not hasattr(deep_ep, "Buffer"):
        return Probe(False, "deep_ep has no Buffer", "install DeepEP v1.x")
    try:
        utils = importlib.import_module("deep_ep.utils")
    except Exception as err:
        return Probe(False, f"import deep_ep.utils failed: {err}", "install DeepEP v1.x")
    if not hasattr(utils, "EventOverlap"):
        version = getattr(deep_ep, "__version__", "?")
        return Probe(
            False,
            f"deep_ep {version} looks like DeepEP v2: deep_ep.utils lacks EventOverlap, which "
            "megatron-core's fused_a2a imports",
            "install DeepEP v1.x (e.g. v1.2.1)",
        )
    buffer = deep_ep.Buffer
    if not hasattr(buffer, "get_dispatch_layout") or not hasattr(buffer, "dispatch"):
        return Probe(
            False, "deep_ep.Buffer lacks get_dispatch_layout/dispatch", "install DeepEP v1.x"
        )
    return Probe(True, f"deep_ep {getattr(deep_ep, '__version__', '?')} (v1 API)")


def probe_te_blockwise() -> Probe:
    """Does TransformerEngine (or MT-TransformerEngine) provide Float8BlockScaling?"""
    if importlib.util.find_spec("transformer_engine") is None:
        return Probe(
            False,
            "transformer_engine is not installed",
            "install TransformerEngine >= 2.3 (MT-TE on MUSA)",
        )
    try:
        recipe = importlib.import_module("transformer_engine.common.recipe")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # the CPU meta package raises RuntimeError on import
        return Probe(
            False,
            f"transformer_engine does not import: {type(err).__name__}: {err}",
            "install a TransformerEngine build for this device (never the bare meta package)",
        )
    if not hasattr(recipe, "Float8BlockScaling"):
        return Probe(
            False,
            "this TransformerEngine has no Float8BlockScaling",
            "upgrade TransformerEngine to >= 2.3",
        )
    return Probe(True, "transformer_engine with Float8BlockScaling")


def probe_mooncake() -> Probe:
    """Is Mooncake Transfer Engine (``mooncake.engine.TransferEngine``) importable?"""
    if importlib.util.find_spec("mooncake") is None:
        return Probe(
            False,
            "mooncake is not installed",
            "pip install mooncake-transfer-engine-non-cuda (CPU/TCP) or mooncake-transfer-engine (CUDA)",
        )
    try:
        engine = importlib.import_module("mooncake.engine")
    except Exception as err:
        fix = "apt-get install libibverbs1" if "libibverbs" in str(err) else "reinstall Mooncake"
        return Probe(False, f"import mooncake.engine failed: {err}", fix)
    if not hasattr(engine, "TransferEngine"):
        return Probe(False, "mooncake.engine has no TransferEngine", "reinstall Mooncake")
    return Probe(True, "mooncake.engine.TransferEngine")
