"""One gloo transport device for every process group a long-lived test worker makes.

torch gives each gloo process group a transport device of its own, and each device runs an I/O
thread that wakes every 10 ms even when the group is idle. A pool worker keeps the groups of every
layout it has served (``tiny_gpt._use_layout``: destroying them on one rank busy-loops the peers),
so a worker ends a session with 70-90 such threads, and the session's workers together spent about
a quarter of CI's two cores waking them while the pools sat idle between tests. Groups sharing one
device share its one thread; gloo supports many contexts per device (its own tests make several),
and the collectives, the point-to-point calls and their async forms on different groups at once
behave as before (``tests/test_workers.py``).

TEST-TIME ONLY: ``GlooWorkerPool``'s workers (the test suite's pools, and the differential runs of
``titan-plugins verify``) call :func:`share_one_device` before their world group exists. A user's
training job keeps torch's device per group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["share_one_device", "shared"]

_SHARED: list[Any] = []  # the device, once made in this process


def shared() -> bool:
    """Whether this process's new gloo groups share one device."""
    return bool(_SHARED)


def share_one_device() -> None:
    """Make every gloo group created from now on in this process use one transport device.

    Call it after the process's last fork (a device owns a thread) and before
    ``init_process_group``. Idempotent. It replaces the ``ProcessGroupGloo`` that torch's group
    factory (``distributed_c10d._new_process_group_helper``) constructs with a subclass whose
    ``(store, rank, size, timeout)`` constructor passes options naming the shared device, so
    ``isinstance`` checks and every other use of the class are unchanged.
    """
    if _SHARED:
        return
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    device = base.create_default_device()

    class SharedDeviceProcessGroupGloo(base):  # type: ignore[misc, valid-type]
        """``ProcessGroupGloo`` on the process's one shared transport device."""

        def __init__(
            self, store: Any, rank: int, size: int, timeout: timedelta = c10d.default_pg_timeout
        ) -> None:
            options = base._Options()
            options._timeout = timeout
            options._devices = [device]  # the rest as torch sets it: _Options() has its defaults
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceProcessGroupGloo
    _SHARED.append(device)
