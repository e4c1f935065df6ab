"""The ``sglang.srt.plugins`` entry point: SGLang's plugin loader calls :func:`register` once in
each of its processes (the server or ``Engine``, each scheduler before it loads the model, the
detokenizer), and the registry activates there with the same switches, STRICT and report as
under Megatron.

SGLang logs and swallows an ``Exception`` from a plugin, so a plugin failure never stops the
engine, except where the user asked for that: under ``TITAN_PLUGINS_STRICT=1`` a bad setting or a
failed patch ends the process with :class:`SystemExit` and the message.
"""

from __future__ import annotations

import sys

CHANNEL = "sglang.srt.plugins"


def register() -> None:
    """Activate the registry in this SGLang process and say so in one line."""
    from titan_plugins import activation, settings
    from titan_plugins.hosts.sglang import process
    from titan_plugins.patching.engine import PatchError

    role = process.record(sys._getframe(1))
    pid = process.PROCESS["pid"]
    try:
        state = activation.apply(channel=CHANNEL)
    except (settings.SettingError, PatchError) as err:  # STRICT asked for a stop
        raise SystemExit(f"[titan_plugins] sglang {role}: {err}") from err
    records = state.manager.records.values() if state.manager is not None else ()
    plugins = ", ".join(f"{r.name} ({r.state})" for r in records) or "none"
    # printed, not logged: SGLang configures logging only after its plugins load, so a log
    # record here would be dropped; one line per process is what the user needs to see
    print(
        f"[titan_plugins] sglang {role} (pid {pid}): {state.detail}; plugins: {plugins}",
        file=sys.stderr,
        flush=True,
    )
