"""Which DeepEP-v1-API backend runs: an installed, compatible DeepEP, or ours on torch.distributed.

Decided once per process, lazily (when megatron's fused_a2a is imported or a report asks), never at
import of the plugin. A DeepEP that is installed but unusable (DeepEP v2, whose ``deep_ep.utils``
lacks ``EventOverlap``; MT-DeepEP builds that renamed ``num_nvl_bytes``; a broken build) gives a
clear warning naming the fix and falls back; under ``TITAN_PLUGINS_STRICT=1`` it raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

TORCH, DEEP_EP = "torch.distributed", "deep_ep"
_FIX = "install DeepEP v1.x (tag v1.2.1), or set TITAN_MOE_EP_OVERLAP_BACKEND=torch"


@dataclass(frozen=True)
class Selection:
    """The chosen backend: its name, why, and (``api``) a namespace with Buffer/Config/..."""

    backend: str
    detail: str
    module: Any = None  # the installed deep_ep, when it was chosen

    @property
    def api(self) -> Any:
        """The DeepEP-shaped API in use (ours is imported only when asked for)."""
        return self.module if self.module is not None else torch_backend_api()


_selected: Selection | None = None


def torch_backend_api() -> SimpleNamespace:
    """Our backend as a DeepEP-shaped namespace (``api.Buffer``, ``api.utils.EventOverlap``)."""
    from titan_moe_ep_overlap.buffer import Buffer
    from titan_moe_ep_overlap.deepep_config import Config
    from titan_moe_ep_overlap.events import EventHandle, EventOverlap

    utils = SimpleNamespace(EventHandle=EventHandle, EventOverlap=EventOverlap)
    return SimpleNamespace(
        Buffer=Buffer, Config=Config, EventHandle=EventHandle, EventOverlap=EventOverlap,
        utils=utils, __name__="titan_moe_ep_overlap",
    )  # fmt: skip


def installed() -> bool:
    """Whether a ``deep_ep`` package is importable (found, not imported)."""
    from titan_moe_ep_overlap.deep_ep_lookup import deep_ep_installed

    return deep_ep_installed()


def api_problem() -> str | None:
    """Why the installed ``deep_ep`` cannot serve megatron-core 0.16's fused_a2a (None: it can)."""
    from titan_plugins import platform

    probe = platform.probe_deep_ep()
    if not probe.available:
        return probe.detail
    deep_ep = importlib.import_module("deep_ep")
    buffer = deep_ep.Buffer
    missing = [
        name
        for name in ("get_dispatch_layout", "dispatch", "combine", "get_dispatch_config",
                     "get_combine_config", "set_num_sms")
        if not hasattr(buffer, name)
    ]  # fmt: skip
    if missing:
        return f"deep_ep.Buffer lacks {', '.join(missing)} (not the DeepEP v1 API)"
    try:
        params = inspect.signature(buffer.__init__).parameters
    except (TypeError, ValueError):  # pybind11 constructors may not expose a signature
        return None
    if "num_nvl_bytes" not in params and "num_mtl_bytes" in params:
        return "deep_ep.Buffer takes num_mtl_bytes (MT-DeepEP); megatron reads num_nvl_bytes"
    return None


def select_backend() -> Selection:
    """Choose (once) and return the backend; see the module docstring for the rules."""
    global _selected
    if _selected is not None:
        return _selected
    from titan_moe_ep_overlap import settings
    from titan_plugins.settings import complain

    choice = settings.BACKEND.read()
    if choice == "torch":
        _selected = Selection(TORCH, "forced by TITAN_MOE_EP_OVERLAP_BACKEND=torch", None)
    elif not installed():
        if choice == "deep_ep":
            complain(f"moe_ep_overlap: TITAN_MOE_EP_OVERLAP_BACKEND=deep_ep but deep_ep is not "
                     f"installed; using the torch.distributed backend. Fix: {_FIX}")  # fmt: skip
        _selected = Selection(TORCH, "deep_ep is not installed", None)
    else:
        problem = api_problem()
        if problem is None:
            deep_ep = importlib.import_module("deep_ep")
            version = getattr(deep_ep, "__version__", "v1")
            _selected = Selection(DEEP_EP, f"deep_ep {version} (v1 API)", deep_ep)
        else:
            complain(f"moe_ep_overlap: the installed deep_ep is not usable by megatron-core: "
                     f"{problem}; using the torch.distributed backend. Fix: {_FIX}")  # fmt: skip
            _selected = Selection(TORCH, f"installed deep_ep unusable: {problem}", None)
    return _selected


def uses_torch_backend() -> bool:
    """Whether megatron must be given our backend (no compatible DeepEP chosen)."""
    return select_backend().backend == TORCH


def reset() -> None:
    """Forget the decision (tests; a new activation re-probes)."""
    global _selected
    _selected = None
