"""The error rewind raises when rolling back cannot help: the core's
:class:`titan_plugins.errors.JobStopped` contract (``primary``, ``exit_code``, ``step``,
``reason``, ``knobs``), so a launcher catches it without importing this plugin and prints one
message per job: ``str(err)`` where ``err.primary``, and every rank exits with ``err.exit_code``.
"""

from __future__ import annotations

from titan_plugins.errors import JobStopped


class RewindError(JobStopped):
    """Training cannot recover by rewinding (repeated faults, or a fault with nothing to roll
    back to). Raised on every rank in the same step (the decision is collective); rank 0's
    message is the job's, the others' one line pointing at it."""
