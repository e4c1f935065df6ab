"""Root test configuration shared by the core's and every plugin's tests."""

import os

# Tests activate plugins explicitly (titan_plugins.testing.plugin_active); the automatic channel
# would otherwise apply every installed plugin inside the pytest process.
os.environ["TITAN_PLUGINS_AUTOLOAD"] = "0"
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

pytest_plugins = ["titan_plugins.testing.pytest_plugin"]
