"""Helpers for plugin authors' tests.

- :func:`plugin_active`, :func:`fresh_manager`, :func:`environ`: activate a plugin through the
  real engine for one test.
- :func:`fake_entry_point`, :func:`fake_module`: discovery tests without installing anything.
- :mod:`~titan_plugins.testing.cpu_harness`: unmodified megatron-core on CPU/gloo (test only).
- :mod:`~titan_plugins.testing.tiny_gpt`: a tiny MoE GPT built and trained with megatron-core.
- :mod:`~titan_plugins.testing.workers`: long-lived gloo worker processes shared across tests.
- :mod:`~titan_plugins.testing.pytest_plugin`: the ``gloo_pool2`` / ``gloo_pool4`` fixtures.

The heavy submodules import torch and megatron; they load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from titan_plugins.testing.activation import environ, fresh_manager, plugin_active
from titan_plugins.testing.fakes import FakeDistribution, fake_entry_point, fake_module

_LAZY = ("cpu_harness", "tiny_gpt", "workers", "model_state")

__all__ = [
    "FakeDistribution",
    "environ",
    "fake_entry_point",
    "fake_module",
    "fresh_manager",
    "plugin_active",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"titan_plugins.testing.{name}")
    raise AttributeError(name)
