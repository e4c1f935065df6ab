"""Activation: build the manager, check every switch and knob, register every enabled plugin's
patches, and watch imports.

An :class:`Activation` goes ``idle -> armed -> active`` (or ``off`` / ``failed``) and back with
:meth:`Activation.stop`. Three channels create one: the ``torch.backends`` entry point
(:func:`autoload`: arms a one-shot trigger, so the plugins load at the first ``import megatron``
and processes that never touch Megatron pay almost nothing), an explicit :func:`apply`, and the
``titan-run`` launcher. ``titan_plugins.testing`` builds its own and installs it for a block
with :func:`use`.

STRICT (``TITAN_PLUGINS_STRICT=1``): a bad switch or knob value, version drift and failed patches
raise at activation, i.e. out of the first ``import megatron``, whatever the import order;
``import torch`` itself never raises.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from titan_plugins import settings, switches
from titan_plugins._log import DEBUG_HINT, configure, logger
from titan_plugins.patching.engine import PatchEngine, PatchError
from titan_plugins.patching.status import FAILED
from titan_plugins.patching.watcher import ImportTrigger, PatchWatcher

if TYPE_CHECKING:
    from titan_plugins.manager import TitanPluginManager
    from titan_plugins.patching.record import Patch

TRIGGER_PREFIXES = ("megatron",)
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
        self.trigger: ImportTrigger | None = None
        self.late = False  # armed while megatron was already importing
        self.superseded: Activation | None = None  # an armed automatic channel apply() took over
        self.errors: list[str] = []  # plugins that failed to register
        self.problems: list[str] = []  # bad switch / knob values
        self.seconds = 0.0

    @property
    def is_active(self) -> bool:
        """Whether plugins are loaded and their patches registered."""
        return self.state == ACTIVE

    @property
    def inactive_reason(self) -> str:
        """Why nothing is active (empty when active)."""
        return "" if self.is_active else self.detail

    # ---------------------------------------------------------------- lifecycle
    def arm(self, prefixes: tuple[str, ...] | None = None) -> None:
        """Start at the first import of a module under ``prefixes``. Never raises.

        If such a module is already importing (``import megatron.core`` imported torch, whose
        entry point got us here), the trigger fires at megatron's next submodule import, so a
        STRICT error surfaces out of ``import megatron``, never out of ``import torch``.
        """
        try:
            if self.state != IDLE:
                return
            if not switches.MASTER.read():
                self.state, self.detail = OFF, "TITAN_PLUGINS=0"
                return
            if not switches.AUTOLOAD.read():
                self.state, self.detail = OFF, "TITAN_PLUGINS_AUTOLOAD=0"
                return
        except settings.SettingError:
            pass  # a malformed switch under STRICT: arm anyway, start() raises it at megatron
        except Exception as err:  # never let import torch fail because of us
            self._failed_quietly(err)
            return
        try:
            self.trigger = ImportTrigger(prefixes or TRIGGER_PREFIXES, self._triggered)
            self.trigger.install()
            self.state = ARMED
            self.detail = "armed: plugins load when megatron is first imported"
        except Exception as err:
            self._failed_quietly(err)

    def _triggered(self) -> None:
        try:
            self.start()
        except (settings.SettingError, PatchError):
            raise  # STRICT asked for errors: out of ``import megatron``
        except Exception as err:
            self.state, self.detail = FAILED, f"failed: {type(err).__name__}: {err}"
            logger.warning("activation failed (%s); %s", self.detail, DEBUG_HINT)
            logger.debug("activation traceback", exc_info=True)

    def _failed_quietly(self, err: BaseException) -> None:
        self.state, self.detail = FAILED, f"failed: {type(err).__name__}: {err}"
        try:
            configure()
            logger.warning("autoload failed (%s); %s", self.detail, DEBUG_HINT)
            logger.debug("autoload traceback", exc_info=True)
        except Exception:
            pass

    def start(self) -> Activation:
        """Activate now; idempotent. Nothing is left half-applied when it raises.

        :raises SettingError: a bad switch or knob value under STRICT.
        :raises PatchError: version drift or a failed patch under STRICT.
        """
        if self.state == ACTIVE:
            return self
        if self.trigger is not None:
            self.trigger.disarm()
        configure()
        started = time.perf_counter()
        with settings.strictness(self.strict):
            self._check(settings.problems(switches.CORE_SETTINGS))
            if not switches.MASTER.read():
                self.state, self.detail = OFF, "TITAN_PLUGINS=0"
                return self
            from titan_plugins.manager import get_plugin_manager

            pm = get_plugin_manager(only=self.only, entry_points=self.entry_points)
            self._check(pm.problems + plugin_setting_problems(pm))
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
        from titan_plugins import train_step

        train_step.reset()
        self.state = ACTIVE
        if self.trigger is None:
            self.detail = f"activated via {self.channel}"
        elif self.late:
            self.detail = "activated (megatron already importing)"
        else:
            self.detail = "activated on first megatron import"
        self.seconds = time.perf_counter() - started
        logger.debug("activated via %s in %.1f ms", self.channel, self.seconds * 1e3)
        return self

    def _check(self, problems: list[str]) -> None:
        """Report every problem; under STRICT raise one error listing them all."""
        self.problems.extend(problems)
        if problems and settings.strict():
            raise settings.SettingError("; ".join(problems) + settings.STRICT_SUFFIX)
        for problem in problems:
            settings.complain(problem, "ignored: the default applies")

    def stop(self) -> list[str]:
        """Undo every patch that is still ours and go back to idle.

        :return: targets left alone because something else rebound them after us.
        """
        if self.trigger is not None:
            self.trigger.disarm()
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
    state = _CURRENT
    if state is not None and state.superseded is not None:
        previous = state.superseded
        return {
            "ran": True,
            "channel": previous.channel,
            "state": f"armed, then taken over by {state.channel}",
        }
    if state is None or state.channel not in ("torch.backends", "titan-run"):
        return {"ran": False, "state": "not run in this process"}
    detail = f"off: {state.detail}" if state.state == OFF else state.detail
    return {"ran": True, "channel": state.channel, "state": detail}


def apply(only: list[str] | None = None, strict: bool | None = None) -> Activation:
    """Explicit activation (``import titan_plugins; titan_plugins.apply()``); idempotent.

    Works with ``TITAN_PLUGINS_AUTOLOAD=0``; honours ``TITAN_PLUGINS=0`` and the other switches.
    An armed automatic channel is taken over (its trigger is disarmed).
    """
    global _CURRENT
    if _CURRENT is not None and _CURRENT.is_active:
        return _CURRENT
    state = Activation("apply", only=only, strict=strict)
    if _CURRENT is not None and _CURRENT.trigger is not None:
        _CURRENT.trigger.disarm()
        state.superseded = _CURRENT
    _CURRENT = state
    return state.start()


def undo() -> list[str]:
    """Undo every patch that is still ours and forget the activation.

    :return: targets left alone because something else rebound them after us.
    """
    global _CURRENT
    if _CURRENT is None:
        return []
    left = _CURRENT.stop()
    _CURRENT = None
    return left


def arm(channel: str) -> None:
    """Arm lazy activation for ``channel`` (torch.backends or titan-run); idempotent, never
    raises. ``TITAN_PLUGINS_AUTOLOAD=0`` turns off every automatic channel; only an explicit
    :func:`apply` ignores it."""
    global _CURRENT
    try:
        if _CURRENT is not None and _CURRENT.state in (ARMED, ACTIVE):
            return
        _CURRENT = Activation(channel)
        late = any(name.split(".", 1)[0] in TRIGGER_PREFIXES for name in list(sys.modules))
        _CURRENT.arm()
        if late and _CURRENT.state == ARMED:
            _CURRENT.late = True
            _CURRENT.detail = "armed late: megatron was already importing; loads at its next module"
    except Exception as err:  # never let import torch fail because of us
        if _CURRENT is not None:
            _CURRENT._failed_quietly(err)


def autoload() -> None:
    """Body of the torch.backends entry point. Never raises (a raise here breaks every
    ``import torch`` in the environment) and never imports megatron."""
    arm("torch.backends")
