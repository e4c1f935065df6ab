"""DeepEP v1 ``EventHandle`` / ``EventOverlap`` on torch.distributed work handles.

DeepEP's ``EventHandle()`` records a device event on the current stream and its only method,
``current_stream_wait()``, makes the current stream wait for it. Our backend keeps that meaning
for user-created handles and adds one more kind: a handle for communication still in flight
(the ``Work`` objects of async ``all_to_all_single`` calls plus a finaliser, e.g. the combine's
reduction, that must run once the data has arrived). ``current_stream_wait()`` on such a handle
waits for the work (on NCCL/MCCL this makes the current stream wait; on gloo it blocks the host)
and runs the finaliser exactly once, so the results are valid afterwards - the same contract
DeepEP gives with ``async_finish=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_device: list[str] = []  # the process's device type, probed once (it probes importlib each call)


def _record_on_current_stream() -> Any:
    """A platform event recorded on the current stream, or None where streams do not exist."""
    try:
        from titan_plugins import platform
    except ImportError:  # core not importable: behave like the CPU no-op event
        return None
    if not _device:
        _device.append(platform.device_type())
    if _device[0] == "cpu":
        return None
    event = platform.new_event()
    event.record()
    return event


class EventHandle:
    """DeepEP ``EventHandle``: an event on the current stream, or pending communication.

    ``EventHandle()`` (no arguments, what megatron and DeepEP users write) records an event on the
    current stream. The backend creates handles with ``works`` (torch.distributed ``Work``
    objects), ``finalize`` (called once after they completed) and ``keep_alive`` (tensors the
    transfer reads or writes, held until completion because gloo may still touch them).
    """

    def __init__(
        self,
        works: Sequence[Any] = (),
        finalize: Callable[[], None] | None = None,
        keep_alive: Sequence[Any] = (),
    ) -> None:
        self._works = list(works)
        self._finalize = finalize
        self._keep_alive = tuple(keep_alive)
        self._completed = False
        pending = bool(self._works) or finalize is not None
        self._event = None if pending else _record_on_current_stream()

    @property
    def completed(self) -> bool:
        """Whether the communication of this handle finished and its finaliser ran."""
        return self._completed

    def current_stream_wait(self) -> None:
        """Make the current stream (the host, on gloo) wait until this handle's work is done."""
        if self._event is not None:
            self._event.wait()
        if self._completed:
            return
        for work in self._works:
            work.wait()
        if self._finalize is not None:
            self._finalize()
        # drop references only now: until the work completed gloo may read/write these tensors
        self._works, self._finalize, self._keep_alive = [], None, ()
        self._completed = True


class EventOverlap:
    """DeepEP ``EventOverlap``: an optional :class:`EventHandle` plus tensors to keep alive.

    Usable as a context manager (``with event: ...`` waits on exit) like DeepEP's.
    """

    def __init__(
        self, event: EventHandle | None = None, extra_tensors: tuple[Any, ...] | None = None
    ) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (which must exist)."""
        assert self.event is not None, "EventOverlap.current_stream_wait() needs an event"
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def wait_previous(previous_event: EventOverlap | None) -> None:
    """Order an operation after ``previous_event`` (DeepEP waits on it on the comm stream).

    If the event is pending communication of this backend, completing it here is required: its
    results are only valid (and its finaliser only runs) after the wait.
    """
    if previous_event is not None and previous_event.event is not None:
        previous_event.event.current_stream_wait()


def check_stream_args(
    previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool
) -> None:
    """DeepEP's rule: ``allocate_on_comm_stream`` needs ``previous_event`` and ``async_finish``."""
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise AssertionError(
            "allocate_on_comm_stream=True requires previous_event is not None and "
            "async_finish=True (same rule as DeepEP)"
        )
