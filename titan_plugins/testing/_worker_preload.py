"""What the fork server of ``GlooWorkerPool(preloaded=True)`` imports once, so that each worker it
forks starts with torch and megatron.core already imported (about 7 s per worker otherwise).

The server starts with the workers' environment (autoload off, one thread), so importing torch
activates no plugin, and it does nothing but import: no thread pool, no process group, no plugin.
Any failure is left for the worker's own start-up to meet and report.
"""

from __future__ import annotations

import contextlib

with contextlib.suppress(BaseException):
    import torch

    torch.set_num_threads(1)
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()
    import megatron.core  # noqa: F401
