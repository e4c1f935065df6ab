"""The Megatron host room: everything the core knows about Megatron-LM / megatron-core.

- :mod:`~titan_plugins.hosts.megatron.lines`: the supported release lines and their gates
  (:data:`SUPPORTED_MEGATRON`, :func:`megatron_lines`), the package and distribution names;
- :mod:`~titan_plugins.hosts.megatron.train_step`: the hooks on megatron's schedules and
  optimizers (``TrainStep``, ``Microbatch``, ``OptimizerStep``);
- :mod:`~titan_plugins.hosts.megatron.patches`: the core's own Megatron patch records (the
  train-step hooks, ``titan_add_arguments`` / ``titan_configure`` wiring);
- :mod:`~titan_plugins.hosts.megatron.schedule`: the model of megatron's schedule order;
- :mod:`~titan_plugins.hosts.megatron.testing`: the CPU harness for unmodified megatron-core on
  gloo and the tiny MoE GPT (test only; torch and megatron, lazily).

Imported only through :data:`titan_plugins.hosts.HOSTS` by the host-neutral core; plugins import
the names they need from here (``from titan_plugins.hosts.megatron import SUPPORTED_MEGATRON``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import titan_plugins.hosts.megatron.train_step as train_step
from titan_plugins.hosts.megatron.lines import (
    DISTRIBUTION,
    LINE_GATES,
    MEGATRON_LINES,
    PACKAGE,
    SUPPORTED_MEGATRON,
    TRIGGER_PREFIXES,
    megatron_lines,
)

if TYPE_CHECKING:
    from titan_plugins.patching.record import Patch

NAME = "megatron"
SUPPORTED = SUPPORTED_MEGATRON
WRAPPER_HOOKS = train_step.WRAPPER_HOOKS
UPSTREAM_TESTS = {"megatron_lm_tests": "tests/unit_tests/"}
"""The upstream test suites whose files a distribution's ``upstream_tests.json`` may select
(:mod:`titan_plugins.verify.selection`): the key in the data file -> the folder of a
Megatron-LM checkout its files live under."""

__all__ = [
    "DISTRIBUTION",
    "LINE_GATES",
    "MEGATRON_LINES",
    "NAME",
    "PACKAGE",
    "SUPPORTED",
    "SUPPORTED_MEGATRON",
    "TRIGGER_PREFIXES",
    "UPSTREAM_TESTS",
    "WRAPPER_HOOKS",
    "bind",
    "core_patches",
    "describe",
    "here",
    "megatron_lines",
    "reset",
]


def core_patches() -> list[Patch]:
    """The core's own Megatron patch records, in registration order (a function, not the
    submodule :mod:`~titan_plugins.hosts.megatron.patches` that holds them)."""
    from titan_plugins.hosts.megatron.patches import core_patches as records

    return records()


def bind(manager_of: Callable[[], Any]) -> None:
    """Where the room's patched functions find the active pluggy manager (or None)."""
    train_step.bind(manager_of)


def reset() -> None:
    """Forget the loop position (a new activation starts counting from 0)."""
    train_step.reset()


def describe() -> dict[str, Any]:
    """Nothing beyond the report's own ``megatron`` entry (where megatron.core comes from)."""
    return {}


def here() -> bool:
    """Whether this process can run Megatron: ``megatron.core`` is importable (looked up, not
    imported; the namespace parent ``megatron`` may be)."""
    import importlib.util

    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except (ImportError, ValueError):
        return False
