"""DeepEP v1 ``Config``: the tuning record megatron asks ``Buffer`` for and sizes buffers with.

Our backend has no SMs or NVLink ring buffers: an all-to-all moves each chunk in one collective.
The class keeps DeepEP's constructor, its argument checks and its two size hints (megatron compares
``Buffer.num_nvl_bytes``/``num_rdma_bytes`` with them to decide when to rebuild the buffer), so
code written against DeepEP runs unchanged.
"""

from __future__ import annotations

NUM_MAX_NVL_PEERS = 8  # DeepEP: ranks per NVLink domain; above it RDMA buffers are needed


class Config:
    """DeepEP ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`` (chunk sizes in tokens)."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise AssertionError("Config: nvl send chunk must be smaller than the recv chunk")
        if num_max_rdma_chunked_send_tokens > num_max_rdma_chunked_recv_tokens // 2:
            raise AssertionError("Config: rdma send chunk must be <= half the rdma recv chunk")
        # DeepEP rounds the RDMA receive chunk up to a multiple of the send chunk
        send = num_max_rdma_chunked_send_tokens
        recv = -(-num_max_rdma_chunked_recv_tokens // send) * send
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = send
        self.num_max_rdma_chunked_recv_tokens = recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the intranode buffer DeepEP would allocate for this config."""
        peers = min(num_ranks, NUM_MAX_NVL_PEERS)
        channels = max(self.num_sms // 2, 1)
        return channels * peers * self.num_max_nvl_chunked_recv_tokens * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the internode buffer; 0 when all ranks fit in one NVLink domain (DeepEP)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        channels = max(self.num_sms // 2, 1)
        rdma_ranks = -(-num_ranks // NUM_MAX_NVL_PEERS)
        return channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * hidden_bytes * 2


def dispatch_config(num_sms: int, num_ranks: int) -> Config:
    """The dispatch config for ``num_ranks`` (DeepEP v1.2.1's value for 8 ranks, any count)."""
    _check_ranks(num_ranks)
    return Config(num_sms, 6, 256, 6, 128)


def combine_config(num_sms: int, num_ranks: int) -> Config:
    """The combine config for ``num_ranks`` (DeepEP v1.2.1's value for 8 ranks, any count)."""
    _check_ranks(num_ranks)
    return Config(num_sms, 4, 256, 6, 128)


def _check_ranks(num_ranks: int) -> None:
    # DeepEP only has tuned tables for some counts and asserts on others (even on 1); collectives
    # have no such limit, so any positive count is accepted here.
    if num_ranks < 1:
        raise AssertionError(f"Unsupported number of EP ranks: {num_ranks}")
