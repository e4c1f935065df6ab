"""PLUGIN_NAME's knobs: each declared once, here, and read only through ``Setting.read()``.

The core checks every enabled plugin's ``SETTINGS`` at activation (a bad value warns naming the
variable and what is accepted, and the default applies; under ``TITAN_PLUGINS_STRICT=1`` it is
an error out of ``import megatron``), and ``titan-plugins env`` lists them. Never read these
variables from ``os.environ`` yourself, and never write a default a second time.
"""

from __future__ import annotations

from titan_plugins.settings import Setting

LOG_EVERY = Setting(
    "TITAN_PLUGIN_UPPER_LOG_EVERY",
    int,
    0,
    "Log this plugin's counters every N training steps (0: never).",
    minimum=0,
)

SETTINGS = [LOG_EVERY]
