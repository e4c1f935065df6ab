"""titan-pp-rdma: megatron-core pipeline P2P over Mooncake Transfer Engine (torch fallback)."""

__version__ = "0.1.0"
