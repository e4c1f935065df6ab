"""The titan-weight-sync distribution's version: the single source read by setup.cfg."""

__version__ = "0.1.0"
