"""Checking the plugins against the host's own tests.

:mod:`~titan_plugins.verify.selection`: which upstream test files exercise each patch, as every
distribution declares it in its ``upstream_tests.json``. Standard library only: never imports the
host or a plugin (a data file is found through its package name, or read by path).
"""
