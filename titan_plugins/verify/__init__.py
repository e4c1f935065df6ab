"""Checking the plugins against the host: ``titan-plugins verify``.

- :mod:`~titan_plugins.verify.selection`: which upstream test files exercise each patch, as
  every distribution declares it in its ``upstream_tests.json`` (standard library only: never
  imports the host or a plugin; a data file is found through its package name, or read by path).
- :mod:`~titan_plugins.verify.differential`: the differential training check (plugins off, each
  alone, all on) on the Megatron this environment imports.
- :mod:`~titan_plugins.verify.cli`: the command.
- :mod:`~titan_plugins.verify.relay`: what its children print, less the native libraries'
  start-up chatter (:mod:`titan_plugins.native_noise`).
- :mod:`~titan_plugins.verify.interrupt` and :mod:`~titan_plugins.verify.children`: Ctrl-C
  stops every process verify started, in one line.
"""
