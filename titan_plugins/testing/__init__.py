"""Helpers for plugin authors' tests.

- :func:`plugin_active`, :func:`fresh_manager`, :func:`environ`: activate a plugin through the
  real engine for one test.
- :func:`fake_entry_point`, :func:`fake_module`: discovery tests without installing anything.
- the Megatron host's CPU harness (unmodified megatron-core on CPU/gloo) and tiny MoE GPT live in
  its room: :mod:`titan_plugins.hosts.megatron.testing`.
- :mod:`~titan_plugins.testing.workers`: long-lived gloo worker processes shared across tests.
- :mod:`~titan_plugins.testing.pytest_plugin`: the ``gloo_pool2`` / ``gloo_pool4`` fixtures.

The heavy submodules import torch and megatron; they load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from titan_plugins.testing.activation import environ, fresh_manager, plugin_active
from titan_plugins.testing.fakes import FakeDistribution, fake_entry_point, fake_module

_LAZY = ("workers",)
# ``from titan_plugins.testing import cpu_harness`` (``testing/megatron_lm.py``) still resolves:
# the harness moved into the Megatron host's room.
_MOVED = {"cpu_harness": "titan_plugins.hosts.megatron.testing.cpu_harness"}

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
    if name in _MOVED:
        return importlib.import_module(_MOVED[name])
    raise AttributeError(name)
