"""Schedule-aware activation offload (titan plugin ``act_offload``)."""

from titan_act_offload.version import __version__ as __version__
