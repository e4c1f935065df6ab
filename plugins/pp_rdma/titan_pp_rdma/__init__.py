"""titan-pp-rdma: megatron-core pipeline P2P over Mooncake Transfer Engine (torch fallback)."""

from titan_pp_rdma.version import __version__ as __version__
