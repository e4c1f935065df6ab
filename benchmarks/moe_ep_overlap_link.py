"""A real, rate-limited network link between two local processes, for ``moe_ep_overlap.py``.

Two network namespaces joined by a veth pair; each end's egress goes through a ``tc`` token bucket
(tbf), so gloo's TCP traffic between the two EP ranks crosses a link of a chosen rate, with the
kernel's real TCP stack, queueing and flow control - not a sleep. Needs root and iproute2
(``ip``, ``tc``): ``apt-get install iproute2`` on Debian/Ubuntu.

Everything created here is private and removed again: the namespaces (``titan_moe_<pid>_a/b``),
the veth pair inside them (addresses 10.200.0.1 and 10.200.0.2 exist only inside those two
namespaces) and the qdiscs, on normal exit, on an exception, on SIGINT/SIGTERM, and - for a run
that was SIGKILLed - by the next run, which removes namespaces of dead runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator

PREFIX = "titan_moe_"
ADDRESSES = ("10.200.0.1", "10.200.0.2")  # rank 0 and rank 1; only inside our namespaces
GSO_MAX = 64 << 10  # veth hands tbf packets of up to 64 KiB (GSO); the bucket must hold one
QUEUE_S = 0.1  # queue depth in seconds at the rate (a switch-like buffer, not a bufferbloat)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def missing_tools() -> str | None:
    """Why the link cannot be built here (None: it can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`): apt-get install iproute2"
    if os.geteuid() != 0:
        return "needs root (network namespaces and qdiscs)"
    return None


def remove_stale() -> list[str]:
    """Delete namespaces left by runs of this benchmark whose process is gone (SIGKILL), and
    stop that run's orphaned workers (the processes inside those namespaces, by pid)."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        match = re.match(rf"({PREFIX}(\d+)_[ab])\b", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            for pid in _ip("netns", "pids", match.group(1), check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "delete", match.group(1), check=False)
            removed.append(match.group(1))
    return removed


class Link:
    """Two namespaces and a veth pair; ``ends[r]`` = (namespace, interface, address) of rank r."""

    def __init__(self) -> None:
        tag = f"{PREFIX}{os.getpid()}"
        self.ends = [(f"{tag}_{side}", f"tmoe{os.getpid() % 100000}{side}", address)
                     for side, address in zip("ab", ADDRESSES)]  # fmt: skip
        self.rate_bits: int | None = None

    def create(self) -> None:
        """Build the namespaces and the veth pair (no rate limit yet)."""
        (ns_a, if_a, _), (ns_b, if_b, _) = self.ends
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        _ip("link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        for ns, ifname, address in self.ends:
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # Per namespace: a connection idle for an RTO (the serial path computes between its
            # bursts) would restart from slow start; RDMA/NCCL links have no such ramp, and the
            # rate calibration assumes the link runs at its rate whenever there is data.
            subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                            "echo 0 > /proc/sys/net/ipv4/tcp_slow_start_after_idle"],
                           check=True, capture_output=True)  # fmt: skip

    def limit(self, rate_bytes_per_s: float) -> str:
        """Put a tbf of this rate on both ends' egress; returns the qdisc as tc shows it."""
        self.rate_bits = max(int(rate_bytes_per_s * 8), 8000)
        burst = max(2 * GSO_MAX, int(rate_bytes_per_s / 1000))  # >= one GSO packet, ~1 ms
        limit = max(4 * burst, int(rate_bytes_per_s * QUEUE_S))
        shown = []
        for ns, ifname, _ in self.ends:
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname, "root",
                 "tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst), "limit", str(limit)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            shown.append(
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", ifname],
                               check=True, capture_output=True, text=True).stdout.strip()
            )  # fmt: skip
        return shown[0]

    def prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.ends[rank][0]]

    def destroy(self) -> None:
        """Delete both namespaces (the veth pair and its qdiscs go with them)."""
        for ns, _, _ in self.ends:
            _ip("netns", "delete", ns, check=False)


@contextlib.contextmanager
def link() -> Iterator[Link]:
    """A :class:`Link` for the block, removed on any exit (exception, SIGINT, SIGTERM)."""
    for name in remove_stale():
        print(f"netns: removed {name}, left by a killed run")
    made = Link()

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the ``finally`` below

    previous = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        made.create()
        yield made
    finally:
        made.destroy()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
