"""Errors raised by the pipeline transport (subclasses of RuntimeError, as megatron expects)."""

from __future__ import annotations


class PPRdmaError(RuntimeError):
    """A pipeline P2P transfer failed; the message names the peer, direction and fix."""


class PPRdmaTimeout(PPRdmaError, TimeoutError):
    """A peer did not answer within ``TITAN_PP_RDMA_TIMEOUT_S``."""


class PPRdmaMismatch(PPRdmaError, ValueError):
    """The two stages disagree on the shape or dtype of a pipeline tensor."""
