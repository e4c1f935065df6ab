"""pp_rdma's Mooncake engine: the core's (:mod:`titan_plugins.transport.mooncake`) raising
:class:`PPRdmaError`, with pp_rdma's way out in its messages."""

from __future__ import annotations

from titan_plugins.transport.mooncake import (
    MAX_SLICES,
    SLICE_BYTES,
    rdma_nics,
    resolve_host,
    resolve_protocol,
)
from titan_plugins.transport.mooncake import (
    MooncakeEngine as _CoreEngine,
)
from titan_pp_rdma.errors import PPRdmaError
from titan_pp_rdma.settings import PPRdmaSettings

__all__ = [
    "MAX_SLICES",
    "SLICE_BYTES",
    "MooncakeEngine",
    "rdma_nics",
    "resolve_host",
    "resolve_protocol",
]


class MooncakeEngine(_CoreEngine):
    """The process's TransferEngine for pipeline transfers."""

    def __init__(self, settings: PPRdmaSettings) -> None:
        super().__init__(
            settings,
            who="pp_rdma",
            error=PPRdmaError,
            hint="; check TITAN_PP_RDMA_METADATA / _PROTOCOL / _DEVICE, or set "
            "TITAN_PP_RDMA_BACKEND=torch",
        )
