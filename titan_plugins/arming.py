"""What an automatic channel (the ``torch.backends`` entry point, ``titan-run``) did in this
process: the :class:`Armed` record that :mod:`titan_plugins.autoload` writes when it arms its
trigger and :mod:`titan_plugins.activation` reads when it takes over. A leaf (standard library
only), so the trigger and the activation it fires do not import each other in a circle.
"""

from __future__ import annotations

from typing import Any


class Armed:
    """What an automatic channel did in this process before activation took over."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.trigger: Any = None  # the autoload ImportTrigger, once armed
        self.late = False  # armed while megatron was already importing
        self.state = "not run in this process"
        self.fired = False
        self.fire_seconds = 0.0  # activation at the trigger, its own imports included


_ARMED: Armed | None = None


def armed() -> Armed | None:
    """The automatic channel's record in this process, if one ran."""
    return _ARMED


def record(armed: Armed) -> Armed:
    """Make ``armed`` this process's record (the automatic channel armed again)."""
    global _ARMED
    _ARMED = armed
    return armed


def disarm(taken_over_by: str) -> None:
    """An explicit activation took over: the trigger must not fire any more."""
    if _ARMED is not None and _ARMED.trigger is not None and _ARMED.trigger.armed:
        _ARMED.trigger.disarm()
        _ARMED.state = f"armed, then taken over by {taken_over_by}"
