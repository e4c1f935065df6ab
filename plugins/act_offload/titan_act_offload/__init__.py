"""Schedule-aware activation offload (titan plugin ``act_offload``)."""

__version__ = "0.1.0"
