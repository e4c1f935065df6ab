"""titan-fp8-blockwise: blockwise FP8 training for unmodified Megatron-LM."""

from titan_fp8_blockwise.version import __version__ as __version__
