"""Which SGLang process this is: set by the ``sglang.srt.plugins`` entry point
(``titan_entrypoints.sglang_plugins``) when SGLang's loader calls it, read by the reports.

Standard library only, importing nothing of the core (the room stays a leaf of the core's
import graph).
"""

from __future__ import annotations

import os
from types import FrameType

_ROLES = {
    "run_scheduler_process": "scheduler",
    "run_detokenizer_process": "detokenizer",
    "run_data_parallel_controller_process": "data-parallel controller",
    "_launch_subprocesses": "engine",
    "launch_server": "server",
    "run_server": "server",
}
PROCESS: dict[str, object] = {"role": None, "pid": None}
"""Which SGLang process this is, once the entry point ran here (for reports)."""


def role_of(frame: FrameType | None) -> str:
    """The SGLang process running ``frame``'s stack (scheduler, detokenizer, engine, server...),
    from its functions' names: SGLang sets no process title before it loads plugins."""
    while frame is not None:
        name, where = frame.f_code.co_name, frame.f_code.co_filename
        role = _ROLES.get(name)
        if role is not None:
            return role
        if name == "__init__" and where.endswith("engine.py"):
            return "engine"
        if name == "<module>" and where.endswith(("launch_server.py", "serve.py")):
            return "server"  # python -m sglang.launch_server / sglang serve
        frame = frame.f_back
    return "process"


def record(frame: FrameType | None) -> str:
    """Remember this process's role (from ``frame``'s stack) and pid; returns the role."""
    role = role_of(frame)
    PROCESS.update(role=role, pid=os.getpid())
    return role


__all__ = ["PROCESS", "record", "role_of"]
