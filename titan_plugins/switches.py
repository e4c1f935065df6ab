"""The registry's switches (DESIGN §4): which plugins load, decided at activation time.

A plugin is enabled when every switch allows it: the master switch ``TITAN_PLUGINS``, the
allowlist ``TITAN_PLUGINS_ONLY``, the denylist ``TITAN_PLUGINS_DISABLE`` and its own
``TITAN_<NAME>``. Keys are entry-point names. Names that match no installed plugin are reported
with the list of installed ones and what is applied instead (the list's known names), an error
under ``TITAN_PLUGINS_STRICT=1``.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Iterable

from titan_plugins.host_memory import MAX_HOST_BYTES
from titan_plugins.settings import Problem, Setting, complain, shown_value, strict_value_problem
from titan_plugins.settings import problems as setting_problems

MASTER = Setting(
    "TITAN_PLUGINS", bool, True, "Master switch: 0 loads no plugin and applies no patch."
)
AUTOLOAD = Setting(
    "TITAN_PLUGINS_AUTOLOAD",
    bool,
    True,
    "0 turns off the automatic channels (torch.backends entry point, titan-run); apply() works.",
)
ONLY = Setting("TITAN_PLUGINS_ONLY", list, (), "Comma list of plugin names: load only these.")
DISABLE = Setting(
    "TITAN_PLUGINS_DISABLE", list, (), "Comma list of plugin names not to load; * for all."
)
STRICT = Setting(
    "TITAN_PLUGINS_STRICT",
    bool,
    False,
    "1: a bad switch or knob value, version or signature drift, or a failed patch raises at "
    "activation (the first import of megatron) instead of warning.",
)
PICK = Setting(
    "TITAN_PLUGINS_PICK",
    list,
    (),
    "name=distribution pairs: which distribution provides a plugin name that several "
    "third-party distributions claim.",
    validate=lambda items: next(
        (_pick_problem(item) for item in items if _pick_problem(item)), None
    ),
)


def _pick_problem(item: str) -> str | None:
    # both sides named: "rewind=" or "=titan-rewind" picks nothing, it is not a choice
    name, sep, dist = item.partition("=")
    if sep and name.strip() and dist.strip():
        return None
    return f"{item!r} is not name=distribution (e.g. my_plugin=my-dist)"


DEBUG = Setting("TITAN_PLUGINS_DEBUG", bool, False, "1: log every patch and activation step.")
TRACE = Setting("TITAN_PLUGINS_TRACE", bool, False, "1: log every hook call.")

CORE_SETTINGS: tuple[Setting, ...] = (
    MASTER,
    AUTOLOAD,
    ONLY,
    DISABLE,
    STRICT,
    PICK,
    DEBUG,
    TRACE,
    MAX_HOST_BYTES,
)


def empty_entry_problems() -> list[Problem]:
    """Empty entries of ``TITAN_PLUGINS_ONLY`` / ``_DISABLE`` / ``_PICK`` (``,,,``, ``a,,b``):
    the list reader drops them, so a stray comma would otherwise pass unseen (``ONLY=',,,'``
    allowed every plugin)."""
    found = []
    for setting in (ONLY, DISABLE, PICK):
        text = (os.environ.get(setting.name) or "").strip()
        if not text:
            continue
        entries = text.split(",")
        empty = sum(1 for entry in entries if not entry.strip())
        if not empty:
            continue
        kept = [entry.strip() for entry in entries if entry.strip()]
        applied = f"applying {setting.name}={','.join(kept)}" if kept else "treated as unset"
        if setting.problem() is not None:  # its entries are refused as a whole: the default
            applied = f"default {setting.shown_default()} used"
        what = "an empty entry (a stray comma?): remove it"
        if empty > 1:
            what = f"{empty} empty entries (stray commas?): remove them"
        found.append(Problem(f"{setting.name}={shown_value(text)}: {what}", applied))
    return found


def core_problems() -> list[str]:
    """Every bad value among the core's switches (activation checks them before anything loads)."""
    # STRICT's own bad value is named as what it is, not as "not a switch value" under a
    # message that goes on to say TITAN_PLUGINS_STRICT=1
    own = strict_value_problem()
    found = [Problem(own, "it counts as on")] if own else []
    found += setting_problems(s for s in CORE_SETTINGS if s is not STRICT)
    return found + empty_entry_problems()


def plugin_switch_var(name: str) -> str:
    """The per-plugin switch for entry-point name ``name``: ``fp8_blockwise`` -> TITAN_FP8_BLOCKWISE."""
    return "TITAN_" + re.sub(r"[^0-9A-Za-z]+", "_", name).upper()


_LOWER_WORD = frozenset(string.ascii_lowercase + string.digits)


def _is_lower_snake(name: str) -> bool:
    # ``[a-z][a-z0-9]*(_[a-z0-9]+)*`` (checked for every plugin at each activation) without
    # compiling a pattern inside ``import megatron``
    words = name.split("_")
    return (
        bool(name)
        and name[0] in string.ascii_lowercase
        and all(words)
        and all(_LOWER_WORD.issuperset(word) for word in words)
    )


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a plugin's entry-point name, or None when it can.

    Names are lower snake case (so each maps to exactly one switch variable), and none may have
    a switch inside the core's own ``TITAN_PLUGINS_*`` namespace.
    """
    if not _is_lower_snake(name):
        return f"plugin name {name!r} is not lower snake case (e.g. my_plugin)"
    if name == "plugins" or name.startswith("plugins_"):
        return (
            f"plugin name {name!r} is reserved: its switch {plugin_switch_var(name)} would "
            "collide with the core's TITAN_PLUGINS_* switches"
        )
    return None


def plugin_switch(name: str) -> Setting:
    """The per-plugin on/off switch of entry-point name ``name`` as a Setting."""
    return Setting(plugin_switch_var(name), bool, True, f"0 turns plugin {name} off.")


def _switch_on(name: str, problems: list[str] | None) -> bool:
    switch = plugin_switch(name)
    problem = switch.problem()
    if problem is not None and problems is not None:
        problems.append(problem)
        return switch.default
    return switch.read()


def master_enabled() -> bool:
    """Whether ``TITAN_PLUGINS`` allows anything at all."""
    return MASTER.read()


def autoload_enabled() -> bool:
    """Whether the automatic channel may activate (``TITAN_PLUGINS_AUTOLOAD``)."""
    return AUTOLOAD.read()


def name_problems(installed: Iterable[str]) -> list[Problem]:
    """``TITAN_PLUGINS_ONLY`` / ``_DISABLE`` entries that name no installed plugin, each saying
    what applies instead: the known names of the list (an allowlist of unknown names only
    loads nothing, as an allowlist should; ``*`` means all only in the denylist)."""
    names = set(installed)
    found = []
    for setting in (ONLY, DISABLE):
        items = setting.read()
        wildcard = ("*",) if setting is DISABLE else ()
        unknown = [n for n in items if n not in names and n not in wildcard]
        if not unknown:
            continue
        kept = [n for n in items if n not in unknown]
        if kept:
            applied = f"applying {setting.name}={','.join(kept)}"
        elif setting is ONLY:
            applied = "none is installed, so no plugin loads"
        else:
            applied = "it disables no installed plugin"
        what = "is not an installed plugin" if len(unknown) == 1 else "are not installed plugins"
        found.append(
            Problem(
                f"{setting.name}={shown_value(','.join(items))}: {', '.join(unknown)} {what} "
                f"(installed: {', '.join(sorted(names)) or 'none'})",
                applied,
            )
        )
    return found


def disabled_reasons(
    installed: Iterable[str],
    only: Iterable[str] | None = None,
    problems: list[str] | None = None,
) -> dict[str, str]:
    """Map each installed plugin that must not load to the reason, from the switches.

    :param installed: entry-point names of the installed plugins.
    :param only: an explicit allowlist from the caller (``apply(only=...)``), combined with
        ``TITAN_PLUGINS_ONLY``.
    :param problems: collect unknown names here (activation reports them all at once) instead
        of complaining one by one.
    :return: ``{name: reason}`` for the disabled ones; enabled plugins are absent.
    """
    names = set(installed)
    if not master_enabled():
        return dict.fromkeys(names, "TITAN_PLUGINS=0")
    env_only = ONLY.read()
    deny = DISABLE.read()
    for problem in name_problems(names):
        if problems is None:
            complain(problem, problem.fallback)
        else:
            problems.append(problem)
    reasons: dict[str, str] = {}
    for name in sorted(names):
        if env_only and name not in env_only:
            reasons[name] = f"not in TITAN_PLUGINS_ONLY={','.join(env_only)}"
        elif only is not None and name not in only:
            reasons[name] = "not requested by apply(only=...)"
        elif "*" in deny or name in deny:
            reasons[name] = f"in TITAN_PLUGINS_DISABLE={','.join(deny)}"
        elif not _switch_on(name, problems):
            reasons[name] = f"{plugin_switch_var(name)}=0"
    return reasons
