"""``python -m titan_plugins.plan``: same as ``titan-plugins plan``."""

import sys

from titan_plugins.plan.cli import main

sys.exit(main())
