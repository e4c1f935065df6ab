"""Activation: build the manager, check every switch and knob, register every enabled plugin's
patches, and watch imports.

An :class:`Activation` goes ``idle -> active`` (or ``off`` / ``failed``) with
:meth:`Activation.start` and back with :meth:`Activation.stop`. Three channels create one: the
``torch.backends`` entry point and the ``titan-run`` launcher arm a one-shot trigger
(:mod:`titan_plugins.autoload`, standard library only, so processes that never touch Megatron
pay almost nothing) that starts one at the first ``import megatron``; and an explicit
:func:`apply`. ``titan_plugins.testing`` builds its own and installs it for a block with
:func:`use`.

STRICT (``TITAN_PLUGINS_STRICT=1``): a bad switch or knob value, version drift and failed patches
raise at activation, i.e. out of the first ``import megatron``, whatever the import order;
``import torch`` itself never raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from titan_plugins import arming, namespace, settings, switches
from titan_plugins._log import DEBUG_HINT, configure, logger
from titan_plugins.hosts import HOSTS
from titan_plugins.patching.engine import PatchEngine, PatchError
from titan_plugins.patching.status import FAILED
from titan_plugins.patching.watcher import PatchWatcher

if TYPE_CHECKING:
    from titan_plugins.manager import TitanPluginManager
    from titan_plugins.patching.record import Patch

IDLE, ARMED, ACTIVE, OFF = "idle", "armed", "active", "off"  # and FAILED (patching.status)


class Activation:
    """One activation of the registry.

    :param channel: ``"torch.backends"``, ``"apply"``, ``"titan-run"`` or a test's name.
    :param only: explicit allowlist of plugin names (combined with ``TITAN_PLUGINS_ONLY``).
    :param entry_points: override discovery (tests); defaults to the installed plugins.
    :param strict: raise on bad input (default: ``TITAN_PLUGINS_STRICT``); the CLI passes
        False to collect every problem and report them instead of stopping at the first.
    """

    def __init__(
        self,
        channel: str,
        only: Sequence[str] | None = None,
        entry_points: list[metadata.EntryPoint] | None = None,
        strict: bool | None = None,
    ) -> None:
        self.channel = channel
        self.only = list(only) if only is not None else None
        self.entry_points = entry_points
        self.strict = strict
        self.state = IDLE
        self.detail = "not run in this process"
        self.manager: TitanPluginManager | None = None
        self.engine: PatchEngine | None = None
        self.watcher: PatchWatcher | None = None
        self.armed: arming.Armed | None = None  # the automatic channel that started it
        self.errors: list[str] = []  # plugins that failed to register
        self.problems: list[str] = []  # bad switch / knob values
        self.seconds = 0.0
        self.applied_while_starting = 0.0

    @property
    def is_active(self) -> bool:
        """Whether plugins are loaded and their patches registered."""
        return self.state == ACTIVE

    @property
    def inactive_reason(self) -> str:
        """Why nothing is active (empty when active)."""
        return "" if self.is_active else self.detail

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> Activation:
        """Activate now; idempotent. Nothing is left half-applied when it raises.

        :raises SettingError: a bad switch or knob value under STRICT.
        :raises PatchError: version drift or a failed patch under STRICT.
        """
        if self.state == ACTIVE:
            return self
        configure()
        started = time.perf_counter()
        with settings.strictness(self.strict):
            self._check(switches.core_problems())
            if not switches.MASTER.read():
                self.state, self.detail = OFF, "TITAN_PLUGINS=0"
                return self
            from titan_plugins.manager import get_plugin_manager

            pm = get_plugin_manager(only=self.only, entry_points=self.entry_points)
            self._check(
                pm.problems + plugin_setting_problems(pm) + namespace.activation_problems(pm)
            )
            if switches.TRACE.read():
                pm.add_hookcall_monitoring(
                    lambda name, impls, kw: logger.warning("hook %s(%s)", name, ", ".join(kw)),
                    lambda outcome, name, impls, kw: None,
                )
            engine = PatchEngine()
            try:
                register_patches(pm, engine, self.errors)
                watcher = PatchWatcher(engine)
                watcher.install()
                engine.apply_ready()
            except BaseException:
                engine.undo()
                if "watcher" in locals():
                    watcher.remove()
                raise
        self.manager, self.engine, self.watcher = pm, engine, watcher
        for host in HOSTS.values():
            host.reset()
        self.state = ACTIVE
        if self.armed is None:
            self.detail = f"activated via {self.channel}"
        elif self.armed.late:
            self.detail = "activated (megatron already importing)"
        else:
            self.detail = "activated on first megatron import"
        self.seconds = time.perf_counter() - started
        self.applied_while_starting = engine.apply_seconds  # already inside ``seconds``
        logger.debug("activated via %s in %.1f ms", self.channel, self.seconds * 1e3)
        return self

    def _check(self, problems: list[str]) -> None:
        """Report every problem; under STRICT raise one error listing them all."""
        self.problems.extend(problems)
        if problems and settings.strict():
            raise settings.SettingError("; ".join(problems) + settings.strict_suffix())
        for problem in problems:  # each says what applies instead (a Problem), or is ignored
            settings.complain(problem, getattr(problem, "fallback", "ignored"))

    def stop(self) -> list[str]:
        """Undo every patch that is still ours and go back to idle.

        :return: targets left alone because something else rebound them after us.
        """
        left = self.engine.undo() if self.engine is not None else []
        if self.watcher is not None:
            self.watcher.remove()
        self.manager = self.engine = self.watcher = None
        self.state, self.detail = IDLE, "stopped"
        return left

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable state for reports."""
        return {"channel": self.channel, "state": self.state, "detail": self.detail}


def plugin_setting_problems(pm: TitanPluginManager) -> list[str]:
    """Bad current values of every loaded plugin's declared knobs (and of its own switch)."""
    from titan_plugins.manager import BUILTIN

    found: list[str] = []
    for impl in pm.hook.titan_settings.get_hookimpls():
        if impl.plugin_name == BUILTIN:
            continue  # the core's switches were checked before the manager was built
        try:
            declared = list(impl.function() or [])
        except Exception as err:
            found.append(f"{impl.plugin_name}: titan_settings raised {type(err).__name__}: {err}")
            continue
        found.extend(settings.problems(declared))
    return found


def register_patches(pm: TitanPluginManager, engine: PatchEngine, errors: list[str]) -> None:
    """Call each plugin's ``titan_register_patches`` on its own, so one failing plugin is
    withdrawn (patches undone, reported) while the others keep theirs."""
    for impl in pm.hook.titan_register_patches.get_hookimpls():  # registration order
        name = impl.plugin_name

        def register(patch: Patch, _name: str = name) -> None:
            engine.register(patch, plugin=_name)

        try:
            impl.function(register=register)
        except PatchError:
            raise
        except Exception as err:
            engine.withdraw(name)
            message = f"titan_register_patches raised {type(err).__name__}: {err}"
            errors.append(f"{name}: {message}")
            record = pm.records.get(name)
            if record is not None:
                record.state, record.reason = FAILED, message
            logger.warning("plugin %s failed: %s", name, message)


# -------------------------------------------------------------------- the process's activation
_CURRENT: Activation | None = None


def current() -> Activation | None:
    """The activation of this process (armed, active, off or failed), if any."""
    return _CURRENT


def active() -> Activation | None:
    """The current activation if it is active."""
    return _CURRENT if _CURRENT is not None and _CURRENT.is_active else None


def active_manager() -> TitanPluginManager | None:
    """The pluggy manager of the current activation, or None."""
    state = active()
    return state.manager if state is not None else None


# Each host room finds the active manager through this module's ``active_manager`` (handed
# over here, so no room imports activation back: the core's import graph has no cycle).
for _host in HOSTS.values():
    _host.bind(active_manager)


@contextlib.contextmanager
def use(state: Activation) -> Iterator[Activation]:
    """Make ``state`` the process's activation for the block (tests, embedded hosts)."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, state
    try:
        yield state
    finally:
        _CURRENT = previous


def autoload_state() -> dict[str, Any]:
    """Whether an automatic channel ran in this process, and what it did."""
    armed = arming.armed()
    if armed is None:
        return {"ran": False, "state": "not run in this process"}
    state = armed.state
    if armed.fired and _CURRENT is not None and _CURRENT.armed is armed:
        state = f"off: {_CURRENT.detail}" if _CURRENT.state == OFF else _CURRENT.detail
    return {"ran": True, "channel": armed.channel, "state": state}


def start_armed(armed: arming.Armed) -> None:
    """The automatic channel's trigger fired (first ``import megatron``): start activating.

    Errors of STRICT mode propagate (out of that import); anything else is logged, never raised.
    """
    global _CURRENT
    if _CURRENT is not None and _CURRENT.is_active:
        return
    state = _CURRENT = Activation(armed.channel)
    state.armed = armed
    try:
        state.start()
    except (settings.SettingError, PatchError):
        raise  # STRICT asked for errors: out of ``import megatron``
    except Exception as err:
        state.state, state.detail = FAILED, f"failed: {type(err).__name__}: {err}"
        logger.warning("activation failed (%s); %s", state.detail, DEBUG_HINT)
        logger.debug("activation traceback", exc_info=True)


def apply(
    only: list[str] | None = None, strict: bool | None = None, channel: str = "apply"
) -> Activation:
    """Explicit activation (``import titan_plugins; titan_plugins.apply()``); idempotent.

    Works with ``TITAN_PLUGINS_AUTOLOAD=0``; honours ``TITAN_PLUGINS=0`` and the other switches.
    An armed automatic channel is taken over (its trigger is disarmed). ``channel`` names who
    asked (a host's plugin loader, e.g. ``sglang.srt.plugins``).
    """
    global _CURRENT
    if _CURRENT is not None and _CURRENT.is_active:
        return _CURRENT
    arming.disarm(channel)
    state = _CURRENT = Activation(channel, only=only, strict=strict)
    return state.start()


def undo() -> list[str]:
    """Undo every patch that is still ours and forget the activation.

    :return: targets left alone because something else rebound them after us.
    """
    global _CURRENT
    arming.disarm("undo")
    if _CURRENT is None:
        return []
    left = _CURRENT.stop()
    _CURRENT = None
    return left
