"""Checks of the address and NIC knobs of the plugins that move bytes (standard library only:
the core runs them at activation, inside the first ``import megatron``)."""

from __future__ import annotations

import ipaddress
import os
import re
import socket

# Patterns as text, compiled by re's cache at the first check of a set value: compiling them
# at import cost ~1 ms inside every ``import megatron``, mostly for knobs nobody sets.
_HOSTNAME = r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
_NUMERIC = r"[0-9.]+"  # all digits and dots: meant as an IPv4 address (no top-level domain is)
_NIC = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}"
_INFINIBAND = "/sys/class/infiniband"


def host_problem(value: str) -> str | None:
    """What is wrong with ``value`` as the address this process listens on and peers reach it
    on (None: nothing). A wildcard is refused: Titan never listens on every interface."""
    try:
        if ipaddress.ip_address(value).is_unspecified:
            return (
                "a wildcard is not an address peers can reach, and Titan never listens on "
                "every interface: give this host's address on the job's network"
            )
        return None
    except ValueError:
        pass
    if re.fullmatch(_NUMERIC, value):
        # 999.1.1.1 matches the host-name pattern, but no resolver takes it as a name
        return "not an IPv4 address (four numbers from 0 to 255, e.g. 10.0.0.5)"
    return None if re.fullmatch(_HOSTNAME, value) else "not an IP address or host name"


def local_address(host: str) -> str:
    """The first address ``host`` resolves to that is this host's (a socket can bind to it).

    :raises ValueError: ``host`` does not resolve, or none of its addresses is this host's
        (the message says which, and what to give instead).
    """
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ValueError(
            f"does not resolve ({reason}): give this host's IP address on the job's network"
        ) from None
    for family, _, _, _, sockaddr in found:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))  # port 0: only asks "is it mine"
        except OSError:
            continue
        return str(sockaddr[0])
    shown = ", ".join(sorted({str(info[4][0]) for info in found}))
    what = "is" if shown == host else f"resolves to {shown},"
    raise ValueError(
        f"{what} not an address of this host: give this host's own address on the job's "
        "network (e.g. from `hostname -I`)"
    )


def local_host_problem(value: str) -> str | None:
    """:func:`host_problem`, and: ``value`` resolves to an address of this host (the one this
    process listens on must be its own). None: nothing wrong."""
    problem = host_problem(value)
    if problem:
        return problem
    try:
        local_address(value)
    except ValueError as err:
        return str(err)
    return None


def nic_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a comma-separated list of RDMA device names."""
    bad = [nic for nic in value.split(",") if not re.fullmatch(_NIC, nic.strip())]
    return (
        f"not RDMA device names: {', '.join(map(repr, bad))} (e.g. mlx5_0,mlx5_1)" if bad else None
    )


def rdma_nics() -> list[str]:
    """RDMA devices visible to this host (``/sys/class/infiniband``), empty when none."""
    try:
        return sorted(os.listdir(_INFINIBAND))
    except OSError:
        return []


def absent_nic_problem(value: str) -> str | None:
    """:func:`nic_problem`, and: every named device exists on this host (for a knob used with
    the rdma protocol: Mooncake would otherwise fail at its first transfer, or pick another)."""
    problem = nic_problem(value)
    if problem:
        return problem
    present = rdma_nics()
    absent = [nic.strip() for nic in value.split(",") if nic.strip() not in present]
    if not absent:
        return None
    what = "no such RDMA device" if len(absent) == 1 else "no such RDMA devices"
    here = ", ".join(present) if present else f"none: {_INFINIBAND} is empty or absent"
    return f"{what}: {', '.join(map(repr, absent))} (this host has {here})"
