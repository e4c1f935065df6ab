"""titan-trace-analysis: capture per-rank Kineto traces in unmodified Megatron, analyse them."""

from titan_trace_analysis.version import __version__ as __version__
