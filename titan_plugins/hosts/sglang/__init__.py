"""The SGLang host room: everything the core knows about SGLang (the rollout engines of slime and
miles).

- :mod:`~titan_plugins.hosts.sglang.versions`: the served releases and their gates
  (:data:`SUPPORTED_SGLANG`, :func:`sglang_releases`);
- :mod:`~titan_plugins.hosts.sglang.process`: which SGLang process this is (the server, a
  scheduler, the detokenizer), recorded by the ``sglang.srt.plugins`` entry point
  (``titan_entrypoints.sglang_plugins``) that activates the registry there.

Plugins declare SGLang patches with the same :class:`~titan_plugins.patching.Patch` records as
Megatron's, gated with :func:`sglang_releases` and checked by signature. Imported only through
:data:`titan_plugins.hosts.HOSTS` by the host-neutral core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from titan_plugins.hosts.sglang.process import PROCESS
from titan_plugins.hosts.sglang.versions import (
    DISTRIBUTION,
    LINE_GATES,
    PACKAGE,
    SGLANG_RELEASES,
    SUPPORTED_SGLANG,
    TRIGGER_PREFIXES,
    sglang_releases,
)

if TYPE_CHECKING:
    from titan_plugins.patching.record import Patch

NAME = "sglang"
SUPPORTED = SUPPORTED_SGLANG
WRAPPER_HOOKS: frozenset[str] = frozenset()
UPSTREAM_TESTS: dict[str, str] = {}
"""SGLang's own tests need GPUs throughout; none is selected yet."""

__all__ = [
    "DISTRIBUTION",
    "LINE_GATES",
    "NAME",
    "PACKAGE",
    "SGLANG_RELEASES",
    "SUPPORTED",
    "SUPPORTED_SGLANG",
    "TRIGGER_PREFIXES",
    "UPSTREAM_TESTS",
    "WRAPPER_HOOKS",
    "bind",
    "core_patches",
    "describe",
    "here",
    "reset",
    "sglang_releases",
]


def core_patches() -> list[Patch]:
    """The core's own SGLang patch records: none (SGLang's loader is the activation channel)."""
    return []


def bind(manager_of: Callable[[], Any]) -> None:
    """Nothing of this room calls hooks yet: the manager is not needed."""


def reset() -> None:
    """No per-activation state."""


def describe() -> dict[str, Any]:
    """The installed SGLang (from its metadata: nothing is imported) and, in an SGLang process,
    which one this is (set by the entry point)."""
    from importlib import metadata

    try:
        version: str | None = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = None
    role = PROCESS["role"]
    where = f"; this process: sglang {role} (pid {PROCESS['pid']})" if role else ""
    summary = f"sglang {version}{where}" if version else "not installed"
    return {"version": version, "process": dict(PROCESS), "summary": summary}


def here() -> bool:
    """Whether this process is an SGLang process (SGLang's plugin loader called the entry point
    here); a trainer that merely has SGLang installed, or bundled (miles-rl), is not."""
    return PROCESS["role"] is not None
