"""The ``TITAN_*`` namespace: the names the core, the installed plugins and the project's own
tools declare, and the set variables that none of them does (a typo, named with the closest
declared name).

Activation runs the check inside the first ``import megatron``, so the usual case costs one pass
over ``os.environ``: declarations are gathered only when a ``TITAN_*`` variable is not one of the
core's, and the installed plugins that did not load are asked only when a name is still left.
``titan-plugins env`` words its "typo?" lines with the same :func:`unknown_variables`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from titan_plugins.settings import Problem, Setting
from titan_plugins.switches import CORE_SETTINGS, plugin_switch_var

if TYPE_CHECKING:
    from titan_plugins.manager import TitanPluginManager

PREFIX = "TITAN_"
# Names in the namespace that are no core or plugin knob but are read by the project's own
# launcher, demo, verify and test harness. They are set in processes that import megatron, so
# each is declared here: a user running the README's commands must never see "unknown variable".
OTHER_NAMES: dict[str, str] = {
    "TITAN_RUN": "set by titan-run in the processes it launches",
    "TITAN_DEMO_STATUS": "scripts/demo.sh: the file each demo rank writes its exit status to",
    "TITAN_VERIFY_SKIP_FILE": "titan-plugins verify: the upstream tests a restarted job has done",
    "TITAN_VERIFY_MEGATRON_LM": "titan-plugins verify: the Megatron-LM checkout its workers use",
    "TITAN_VERIFY_FIXTURE_HANG": "the verify tests' fixture checkout: simulate a hung collective",
}
_CORE_NAMES = frozenset(s.name for s in CORE_SETTINGS) | frozenset(OTHER_NAMES)


def unknown_variables(
    declared: Iterable[str],
    environ: Mapping[str, str] | None = None,
    prefixes: tuple[str, ...] = (),
) -> list[Problem]:
    """One problem per set ``TITAN_*`` variable that is neither in ``declared`` nor one of
    :data:`OTHER_NAMES` (nor starts with one of ``prefixes``), with the closest declared name.

    :param declared: every switch and knob name the core and the installed plugins declare.
    :param environ: the environment to look at (default ``os.environ``).
    :param prefixes: namespaces taken as a whole (a plugin whose knobs could not be listed).
    """
    env = os.environ if environ is None else environ
    known = set(declared) | _CORE_NAMES
    found = []
    for var in sorted(v for v in env if v.startswith(PREFIX) and v not in known):
        if prefixes and var.startswith(prefixes):
            continue
        found.append(Problem(_unknown_message(var, known), "ignored"))
    return found


def _unknown_message(var: str, known: set[str]) -> str:
    import difflib  # only when a name is unknown: not inside every ``import megatron``

    close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.6)
    fix = f"did you mean {close[0]}? (or unset it)" if close else "a typo? unset it"
    return f"{var} is set but no installed plugin declares it, nor the core: {fix}"


def activation_problems(
    pm: TitanPluginManager, environ: Mapping[str, str] | None = None
) -> list[Problem]:
    """The set ``TITAN_*`` variables that neither the core nor an installed plugin declares,
    for the activation whose manager is ``pm``: the loaded plugins' knobs, every installed
    plugin's switch, and the knobs of the installed plugins that did not load (switched off,
    failed, or left out of this activation), asked only when a name is still unexplained."""
    env = os.environ if environ is None else environ
    left = [v for v in env if v.startswith(PREFIX) and v not in _CORE_NAMES]
    if not left:
        return []  # the usual case: nothing more to read
    names = {plugin_switch_var(key.split("@")[0]) for key in pm.records}
    names.update(_loaded_knobs(pm))
    left = [v for v in left if v not in names]
    if not left:
        return []
    more, prefixes = not_loaded_knobs(pm)
    return unknown_variables(names | more, {v: env[v] for v in left}, prefixes)


def _loaded_knobs(pm: TitanPluginManager) -> set[str]:
    names = set()
    for impl in pm.hook.titan_settings.get_hookimpls():
        try:
            declared = list(impl.function() or [])
        except Exception:  # reported by the activation's settings check
            continue
        names.update(s.name for s in declared if isinstance(s, Setting))
    return names


def not_loaded_knobs(pm: TitanPluginManager) -> tuple[set[str], tuple[str, ...]]:
    """(names, prefixes) declared by the installed plugins that ``pm`` did not load.

    Their plugin module is not imported (a switched-off plugin stays unimported): the knobs come
    from the package's ``settings`` module (``SETTINGS``, the template's convention), which
    imports only the core. A plugin without one, or whose module fails, owns its
    ``TITAN_<NAME>_`` prefix as a whole, so its knobs are never called typos.
    """
    from titan_plugins import manager

    names: set[str] = set()
    prefixes: list[str] = []
    try:
        installed = manager.discover()
    except Exception:  # an odd environment: judge by what loaded
        return names, ()
    loaded = {pm.get_name(plugin) for plugin in pm.get_plugins()}  # still registered
    for ep in installed:
        if ep.name in loaded:
            continue
        switch = plugin_switch_var(ep.name)
        names.add(switch)
        declared = _settings_module_knobs(ep.module)
        if declared is None:
            prefixes.append(switch + "_")
        else:
            names.update(declared)
    return names, tuple(prefixes)


def _settings_module_knobs(module: str) -> set[str] | None:
    package, dot, _ = module.rpartition(".")
    if not dot:
        return None  # a top-level plugin module: its settings live in the plugin itself
    try:
        declared = importlib.import_module(f"{package}.settings").SETTINGS
        return {s.name for s in declared if isinstance(s, Setting)}
    except Exception:
        return None
