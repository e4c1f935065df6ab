"""Checks of the address and NIC knobs of the plugins that move bytes (standard library only:
the core runs them at activation, inside the first ``import megatron``)."""

from __future__ import annotations

import ipaddress
import re

# Patterns as text, compiled by re's cache at the first check of a set value: compiling them
# at import cost ~1 ms inside every ``import megatron``, mostly for knobs nobody sets.
_HOSTNAME = r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
_NIC = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}"


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
    return None if re.fullmatch(_HOSTNAME, value) else "not an IP address or host name"


def nic_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a comma-separated list of RDMA device names."""
    bad = [nic for nic in value.split(",") if not re.fullmatch(_NIC, nic.strip())]
    return (
        f"not RDMA device names: {', '.join(map(repr, bad))} (e.g. mlx5_0,mlx5_1)" if bad else None
    )
