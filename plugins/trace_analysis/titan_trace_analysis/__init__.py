"""titan-trace-analysis: capture per-rank Kineto traces in unmodified Megatron, analyse them."""

__version__ = "0.1.0"
