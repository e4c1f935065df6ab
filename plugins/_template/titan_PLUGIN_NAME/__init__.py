"""Titan plugin PLUGIN_NAME. Importing this package has no side effect."""

from .version import __version__ as __version__
