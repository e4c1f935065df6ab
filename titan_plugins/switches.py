"""The registry's switches (DESIGN §4): which plugins load, decided at activation time.

A plugin is enabled when every switch allows it: the master switch ``TITAN_PLUGINS``, the
allowlist ``TITAN_PLUGINS_ONLY``, the denylist ``TITAN_PLUGINS_DISABLE`` and its own
``TITAN_<NAME>``. Keys are entry-point names. Names that match no installed plugin are reported
with the list of installed ones (an error under ``TITAN_PLUGINS_STRICT=1``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from titan_plugins.settings import Setting, complain, env_bool, env_list

CORE_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "TITAN_PLUGINS", "1", "Master switch: 0 loads no plugin and applies no patch.", ("0", "1")
    ),
    Setting(
        "TITAN_PLUGINS_AUTOLOAD",
        "1",
        "0 turns off the automatic channel (torch.backends entry point); apply() still works.",
        ("0", "1"),
    ),
    Setting("TITAN_PLUGINS_ONLY", "", "Comma list of plugin names: load only these."),
    Setting("TITAN_PLUGINS_DISABLE", "", "Comma list of plugin names not to load; * for all."),
    Setting(
        "TITAN_PLUGINS_STRICT",
        "0",
        "1: version drift, a failed patch or a bad switch value raises instead of warning.",
        ("0", "1"),
    ),
    Setting("TITAN_PLUGINS_DEBUG", "0", "1: log every patch and activation step.", ("0", "1")),
    Setting("TITAN_PLUGINS_TRACE", "0", "1: log every hook call.", ("0", "1")),
)


def plugin_switch_var(name: str) -> str:
    """The per-plugin switch for entry-point name ``name``: ``fp8_blockwise`` -> TITAN_FP8_BLOCKWISE."""
    return "TITAN_" + re.sub(r"[^0-9A-Za-z]+", "_", name).upper()


def master_enabled() -> bool:
    """Whether ``TITAN_PLUGINS`` allows anything at all."""
    return env_bool("TITAN_PLUGINS", True)


def autoload_enabled() -> bool:
    """Whether the automatic channel may activate (``TITAN_PLUGINS_AUTOLOAD``)."""
    return env_bool("TITAN_PLUGINS_AUTOLOAD", True)


def _check_names(var: str, names: Iterable[str], installed: set[str]) -> None:
    unknown = sorted(n for n in names if n != "*" and n not in installed)
    if unknown:
        known = ", ".join(sorted(installed)) or "none"
        complain(f"{var} names {', '.join(unknown)}, not an installed plugin (installed: {known})")


def disabled_reasons(installed: Iterable[str], only: Iterable[str] | None = None) -> dict[str, str]:
    """Map each installed plugin that must not load to the reason, from the switches.

    :param installed: entry-point names of the installed plugins.
    :param only: an explicit allowlist from the caller (``apply(only=...)``), combined with
        ``TITAN_PLUGINS_ONLY``.
    :return: ``{name: reason}`` for the disabled ones; enabled plugins are absent.
    """
    names = set(installed)
    if not master_enabled():
        return dict.fromkeys(names, "TITAN_PLUGINS=0")
    env_only = env_list("TITAN_PLUGINS_ONLY")
    deny = env_list("TITAN_PLUGINS_DISABLE")
    _check_names("TITAN_PLUGINS_ONLY", env_only, names)
    _check_names("TITAN_PLUGINS_DISABLE", deny, names)
    reasons: dict[str, str] = {}
    for name in sorted(names):
        if env_only and name not in env_only:
            reasons[name] = f"not in TITAN_PLUGINS_ONLY={','.join(env_only)}"
        elif only is not None and name not in only:
            reasons[name] = "not requested by apply(only=...)"
        elif "*" in deny or name in deny:
            reasons[name] = f"in TITAN_PLUGINS_DISABLE={','.join(deny)}"
        elif not env_bool(plugin_switch_var(name), True):
            reasons[name] = f"{plugin_switch_var(name)}=0"
    return reasons
