"""The ``sglang.srt.plugins`` entry point: SGLang's plugin loader calls :func:`register` once in
each of its processes (the engine, each scheduler before it loads the model, the detokenizer), and
the registry activates there with the same switches, STRICT and report as under Megatron.

SGLang logs and swallows an ``Exception`` from a plugin. So a plugin failure never stops the
engine, except where the user asked for that: under ``TITAN_PLUGINS_STRICT=1`` a bad setting or a
failed patch ends the process with :class:`SystemExit` and the message.
"""

from __future__ import annotations

import os
import sys

CHANNEL = "sglang.srt.plugins"
_ROLES = {
    "run_scheduler_process": "scheduler",
    "run_detokenizer_process": "detokenizer",
    "run_data_parallel_controller_process": "data-parallel controller",
    "_launch_subprocesses": "engine",
    "launch_server": "server",
    "run_server": "server",
}
PROCESS: dict[str, object] = {"role": None, "pid": None}
"""Which SGLang process this is, once :func:`register` ran here (for reports)."""


def process_role() -> str:
    """The SGLang process calling us (scheduler, detokenizer, engine...), from the caller's
    frames: SGLang sets no process title before it loads plugins."""
    frame = sys._getframe(1)
    while frame is not None:
        role = _ROLES.get(frame.f_code.co_name)
        if role is not None:
            return role
        if frame.f_code.co_name == "__init__" and frame.f_code.co_filename.endswith("engine.py"):
            return "engine"
        frame = frame.f_back
    return "process"


def register() -> None:
    """Activate the registry in this SGLang process and say so in one log line."""
    from titan_plugins import activation, settings
    from titan_plugins.patching.engine import PatchError

    PROCESS.update(role=process_role(), pid=os.getpid())
    try:
        state = activation.apply(channel=CHANNEL)
    except (settings.SettingError, PatchError) as err:  # STRICT asked for a stop
        raise SystemExit(f"[titan_plugins] sglang {PROCESS['role']}: {err}") from err
    records = state.manager.records.values() if state.manager is not None else ()
    plugins = ", ".join(f"{r.name} ({r.state})" for r in records) or "none"
    # printed, not logged: SGLang configures logging only after its plugins load, so a log
    # record here would be dropped; one line per process is what the user needs to see
    print(
        f"[titan_plugins] sglang {PROCESS['role']} (pid {PROCESS['pid']}): {state.detail}; "
        f"plugins: {plugins}",
        file=sys.stderr,
        flush=True,
    )
