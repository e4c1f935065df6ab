"""The titan-trace-analysis distribution's version: the single source read by setup.cfg."""

__version__ = "0.2.0"
