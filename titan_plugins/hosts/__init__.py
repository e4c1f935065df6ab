"""The hosts the core serves: one room per host (``titan_plugins.hosts.<name>``).

The host-neutral core reaches a host only through :data:`HOSTS` (checked in
``tests/test_architecture_rules.py``). Each room module offers the same small surface:

- ``NAME``; ``PACKAGE`` / ``DISTRIBUTION`` (the package whose ``package_info`` holds the version
  of the code, and the distribution the version gates name); ``TRIGGER_PREFIXES``;
- ``LINE_GATES`` and ``SUPPORTED`` (the gates of the host's release lines, for the engine's
  "written for another line" verdict);
- ``WRAPPER_HOOKS`` (hooks that only wrappers may implement: the room runs the original);
- ``UPSTREAM_TESTS`` (the host's own test suites a distribution's ``upstream_tests.json`` selects
  from: the data file's key -> the folder of a host checkout holding them);
- ``core_patches()`` (the core's own patch records for the host), ``bind(manager_of)`` (how the room
  finds the active manager: handed over by activation, so the room never imports it back),
  ``reset()`` (a new activation starts counting again), ``describe()`` (what the report says
  of the host beyond the Megatron origin: its version, which of its processes this is) and
  ``here()`` (whether this process runs the host: only such hosts' patches decide whether a
  plugin is inactive here).

A room imports the core's leaf modules (records, signatures, settings), never ``activation``,
``manager`` or ``builtin``: the core's import graph has no cycle.
"""

from __future__ import annotations

from titan_plugins.hosts import megatron, sglang

HOSTS = {megatron.NAME: megatron, sglang.NAME: sglang}
"""Host name -> its room (the one registration point of the core)."""

__all__ = ["HOSTS"]
