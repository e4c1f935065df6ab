"""What the fork server of ``GlooWorkerPool(preloaded=True)`` imports once, so that each worker it
forks starts with torch and megatron.core already imported (about 7 s per worker otherwise).

The server starts with the workers' environment (autoload off, one thread), so importing torch
activates no plugin, and it does nothing but import: no thread pool, no process group, no plugin.
Any failure is left for the worker's own start-up to meet and report.

With ``TITAN_VERIFY_MEGATRON_LM`` set (``titan-plugins verify --megatron-lm DIR``), that checkout
goes first on the server's ``sys.path`` before megatron.core is imported: CPython 3.12's fork
server does not take the parent's ``sys.path``, and would preload the installed megatron.
"""

from __future__ import annotations

import contextlib
import os
import sys

from titan_plugins.testing.training_runs import CHECKOUT_ENV

with contextlib.suppress(BaseException):
    checkout = os.environ.get(CHECKOUT_ENV, "")
    if checkout and checkout not in sys.path:
        sys.path.insert(0, checkout)
    import torch

    torch.set_num_threads(1)
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()
    import megatron.core  # noqa: F401
