"""The Megatron host's test harness (test only; torch and megatron, imported by each module).

- :mod:`~titan_plugins.hosts.megatron.testing.cpu_harness`: unmodified megatron-core on
  CPU/gloo (``_cuda_stubs``, ``_cuda_to_cpu``: the CUDA calls it answers on CPU).
- :mod:`~titan_plugins.hosts.megatron.testing.tiny_gpt`: a tiny MoE GPT built and trained with
  megatron-core (``tiny_data``: its batches; ``model_state``: its parameters and states).
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("cpu_harness", "model_state", "tiny_data", "tiny_gpt")


def __getattr__(name: str) -> Any:
    # The submodules import torch and megatron: they load on first attribute access, so that
    # ``titan_plugins.hosts.megatron.testing.tiny_gpt`` works without importing it by name.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
