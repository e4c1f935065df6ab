"""pytest set-up for this distribution's tests.

``titan_plugins.testing.pytest_plugin`` gives the core's fixtures (``gloo_pool1/2/4``: shared
gloo worker processes with megatron imported; a fresh bad-value warning state per test). pytest
takes ``pytest_plugins`` only from the top-level conftest: inside the Titan repository its root
conftest has loaded the fixtures already, so this file declares them only when it is on top
(the plugin tested on its own, outside the repository).
"""

import os
import sys

# Tests activate plugins themselves (titan_plugins.testing.plugin_active); the automatic channel
# would otherwise apply every installed plugin inside the pytest process at `import megatron`.
os.environ["TITAN_PLUGINS_AUTOLOAD"] = "0"

if "titan_plugins.testing.pytest_plugin" not in sys.modules:
    pytest_plugins = ["titan_plugins.testing.pytest_plugin"]
