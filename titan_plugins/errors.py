"""The error a plugin raises to stop the user's job on purpose, with one message for the job.

A plugin that decides training cannot go on (rewind with nothing to roll back to, say) raises a
subclass of :class:`JobStopped` on every rank in the same step (its decision is collective). Rank
0's error carries the job's full message (``primary``); the other ranks' carry a one-line
pointer to it, so a launcher that catches it prints one message per job instead of one traceback
per rank, and ends every rank with ``exit_code``. The CPU demo does (``entrypoints/cpu_demo.py``);
a user's own ``pretrain_gpt.py`` sees an ordinary exception: the core never exits a process.
"""

from __future__ import annotations

from collections.abc import Iterable


class JobStopped(RuntimeError):
    """A plugin stopped the job on purpose; ``str(err)`` is the message for the user.

    :param step: the training step it happened in (None: not in a step).
    :param reason: the reason in a few words.
    :param knobs: the ``TITAN_*`` variables that would have helped (may be empty).
    :param primary: True on the rank whose message is the job's full message.
    """

    exit_code = 3  # the status a launcher ends every rank with

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        reason: str = "",
        knobs: Iterable[str] = (),
        primary: bool = True,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.reason = reason
        self.knobs = tuple(knobs)
        self.primary = primary
