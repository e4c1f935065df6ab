"""``titan-plugins doctor --imports``: import each plugin alone, each in a fresh process, and
name the one whose import ends the process or hangs.

The manager contains a plugin that raises or calls ``sys.exit`` at import, but one that calls
``os._exit``, dies of a signal (a crash in an extension) or never returns takes the host with
it, and the plain doctor too (it imports every plugin in its own process). This replays the
manager's imports in its order (the same switches, the same names), one interpreter each, and
judges each child from the outside: its exit status, its signal, or the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata

from titan_plugins import manager
from titan_plugins.switches import AUTOLOAD

DEFAULT_TIMEOUT_S = 60.0
_DONE = "titan-plugins: import replay: imported"
_RAISED = "titan-plugins: import replay: raised "
# The child: the parent's import path (where the entry points were discovered), then the
# entry point's own load, as the manager does it; any exception is reported, not a traceback.
_CHILD = f"""
import json, sys
from importlib.metadata import EntryPoint
name, value, path = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path[:] = path
try:
    EntryPoint(name, value, {manager.ENTRY_POINT_GROUP!r}).load()
except BaseException as err:
    print({_RAISED!r} + type(err).__name__ + ": " + str(err), flush=True)
else:
    print({_DONE!r}, flush=True)
"""


@dataclass(frozen=True)
class ImportOutcome:
    """What importing one plugin alone did: ``ok`` or why not (``detail``), and how long."""

    name: str
    distribution: str
    version: str
    value: str
    ok: bool
    detail: str
    seconds: float

    @property
    def who(self) -> str:
        """The plugin as the lines name it: its distribution and version, and its target."""
        dist = " ".join(part for part in (self.distribution, self.version) if part)
        return f"{dist or 'unknown distribution'}, {self.value}"


def replay(
    entry_points: list[metadata.EntryPoint] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[list[ImportOutcome], int]:
    """Import each plugin the manager would import, alone, in its own process, in order.

    :param entry_points: override discovery (tests), as for ``get_plugin_manager``.
    :param timeout_s: a child still importing after this long is named as hanging (and killed).
    :return: one outcome per imported plugin, and how many the switches left out.
    """
    pm, planned = manager.import_plan(entry_points=entry_points)
    outcomes = [_replay_one(record, ep, timeout_s) for record, ep in planned]
    return outcomes, sum(r.state == manager.DISABLED for r in pm.records.values())


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # a plugin that imports torch or megatron at import must not arm or start an activation
    # in the child: that would import every other plugin and blame this one for their end
    env[AUTOLOAD.name] = "0"
    return env


def _replay_one(
    record: manager.PluginRecord, ep: metadata.EntryPoint, timeout_s: float
) -> ImportOutcome:
    value = ep.value
    command = [sys.executable, "-c", _CHILD, record.name, value, json.dumps(sys.path)]
    started = time.monotonic()
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_child_env(),
        text=True,
        start_new_session=True,  # a timeout kills the child's whole group, helpers included
    )
    try:
        out, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        ok, detail = False, f"still importing after {timeout_s:g} s: its import hangs the process"
    else:
        ok, detail = _judge(child.returncode, out)
    seconds = time.monotonic() - started
    if ok:
        detail = f"imports alone in {seconds:.1f} s"
    return ImportOutcome(
        record.name, record.distribution, record.version, value, ok, detail, seconds
    )


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        child.kill()
    try:
        child.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a helper that left the group still holds the pipe
        pass


def _judge(returncode: int, out: str) -> tuple[bool, str]:
    """(ok, why not) from the child's exit status and its last report line."""
    lines = out.splitlines()
    if _DONE in lines:
        if returncode == 0:
            return True, ""
        # the import returned, then something it left behind (an atexit handler) ended it
        return False, f"imports, then the process ended at exit with status {returncode}"
    raised = [line[len(_RAISED) :] for line in lines if line.startswith(_RAISED)]
    if raised:
        return False, f"raises at import ({raised[-1]}): the manager leaves it out"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return False, f"its import ended the process: killed by {name}"
    return False, f"its import ended the process with exit status {returncode}"
