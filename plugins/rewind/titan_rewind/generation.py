"""Which activation of the registry this process is in (one counter, no imports).

The plugin bumps it when an activation registers it; the runtime starts a fresh state machine
the first time it is asked after a bump. Keeping the counter apart lets the plugin module stay
light while megatron imports: the runtime, its detectors and collectives load at the first
training step.
"""

from __future__ import annotations

_GENERATION = [0]


def bump() -> None:
    """A new activation registered the plugin."""
    _GENERATION[0] += 1


def current() -> int:
    """The latest activation's number (0: never activated in this process)."""
    return _GENERATION[0]
