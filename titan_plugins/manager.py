"""``get_plugin_manager()``: the pluggy manager, with discovery that never breaks the host.

Each plugin loads under its own error boundary (``BaseException``: a ``sys.exit`` at import ends
only that plugin; Ctrl-C is reported, then re-raised), with a watchdog that names a plugin whose
import hangs; each import is logged at debug level before it starts (one that ends the process
is the last line). Names are checked before anything is imported: a first-party name (the plugins
this project ships) belongs to its own distribution; two third-party distributions claiming one
name both stay out until the user picks one (``TITAN_PLUGINS_PICK``); names whose switch would
collide with the core's switches are refused.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from importlib import metadata
from typing import Any

import pluggy

from titan_plugins import hookspecs
from titan_plugins._log import logger
from titan_plugins.hosts import HOSTS
from titan_plugins.patching import origin
from titan_plugins.patching.status import FAILED
from titan_plugins.switches import PICK, disabled_reasons, name_problem

ENTRY_POINT_GROUP = "titan_plugins"
# A plugin's load state: enabled, disabled by a switch, or failed (the one FAILED of the core).
ENABLED, DISABLED = "enabled", "disabled"
BUILTIN = "titan-core"
# The plugins this project ships: the name is reserved for its own distribution.
FIRST_PARTY = {
    "fp8_blockwise": "titan-fp8-blockwise",
    "moe_ep_overlap": "titan-moe-ep-overlap",
    "act_offload": "titan-act-offload",
    "pp_rdma": "titan-pp-rdma",
    "trace_analysis": "titan-trace-analysis",
    "rewind": "titan-rewind",
    "weight_sync": "titan-weight-sync",
}
# Hooks that only wrappers may implement (each host room runs the original function).
WRAPPER_HOOKS = tuple(hook for host in HOSTS.values() for hook in host.WRAPPER_HOOKS)
SLOW_IMPORT_S = 5.0  # the watchdog names a plugin whose import runs longer than this


class PluginRecord:
    """What discovery found for one entry point, and what became of it.

    :param name: the entry point's name.
    :param distribution: the distribution that installed it (empty if unknown).
    :param version: that distribution's version.
    :param value: the entry point's ``module[:attr]``.
    """

    # A plain class: a dataclass costs ~1 ms to build inside every ``import megatron``.
    def __init__(
        self, name: str, distribution: str = "", version: str = "", value: str = ""
    ) -> None:
        self.name = name
        self.distribution = distribution
        self.version = version
        self.value = value
        self.state = ENABLED
        self.reason = ""
        self.plugin: Any = None

    def __repr__(self) -> str:
        return f"PluginRecord({self.name!r}, {self.distribution!r}, {self.version!r}, state={self.state!r})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.value,
            "state": self.state,
            "reason": self.reason,
        }


class TitanPluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers every discovered plugin's record."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.records: dict[str, PluginRecord] = {}
        self.problems: list[str] = []  # bad switch values seen while deciding what loads


def discover(path: list[str] | None = None) -> list[metadata.EntryPoint]:
    """The ``titan_plugins`` entry points of the installed distributions, as
    ``importlib.metadata.entry_points(group=...)`` finds them (the first distribution of each
    name on ``sys.path`` wins, shadowed copies are ignored).

    ``entry_points()`` parses every distribution's entry points (~5 ms in an environment with
    Megatron, inside every ``import megatron``); this reads each ``entry_points.txt`` as text
    and parses only the few that mention the group.

    :param path: directories to search instead of ``sys.path`` (tests).
    """
    found: list[metadata.EntryPoint] = []
    seen: set[str] = set()
    dists = metadata.distributions() if path is None else metadata.distributions(path=path)
    for dist in dists:
        name = _normalized_name(dist)
        if name in seen:
            continue  # shadowed by an earlier copy on the path, with entry points or not
        seen.add(name)
        text = _entry_points_text(dist)
        if text and ENTRY_POINT_GROUP in text:
            found.extend(dist.entry_points.select(group=ENTRY_POINT_GROUP))
    return found


def _normalized_name(dist: metadata.Distribution) -> str:
    # the key entry_points() deduplicates by (computed from the folder name, no METADATA read)
    name = getattr(dist, "_normalized_name", None)
    if isinstance(name, str):
        return name
    return origin.normalize(dist.metadata["Name"] or "").replace("-", "_")


_PATH_READ_TEXT = metadata.PathDistribution.read_text


def _entry_points_text(dist: metadata.Distribution) -> str | None:
    # A folder on disk is read with open() (Distribution.read_text goes through pathlib and
    # an exception per distribution without the file); zips and others take read_text.
    folder = getattr(dist, "_path", None)
    if not isinstance(folder, os.PathLike) or type(dist).read_text is not _PATH_READ_TEXT:
        return dist.read_text("entry_points.txt")
    try:
        with open(os.path.join(folder, "entry_points.txt"), encoding="utf-8") as file:
            return file.read()
    except OSError:
        return None


@functools.lru_cache(maxsize=256)
def _identity(dist: Any) -> tuple[str, str]:
    """(name, version) of a distribution from one read of its metadata: ``dist.name`` and
    ``dist.version`` each re-read and re-parse the METADATA file, at every activation."""
    if dist is None:
        return "", ""
    # The two headers come first in METADATA; reading them directly skips the email parser
    # (about 0.3 ms a distribution, at every activation). Anything unusual takes the parser.
    read = getattr(dist, "read_text", None)
    text = (read("METADATA") or read("PKG-INFO") or "") if callable(read) else ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line:
            break  # the headers end at the first blank line
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in found:
            found[key] = value.strip()
    if found.get("Name") and found.get("Version"):
        return found["Name"], found["Version"]
    md = dist.metadata
    return md.get("Name") or "", md.get("Version") or ""


def _dist_name(ep: metadata.EntryPoint) -> str:
    return _identity(getattr(ep, "dist", None))[0]


def _record(ep: metadata.EntryPoint) -> PluginRecord:
    name, version = _identity(getattr(ep, "dist", None))
    return PluginRecord(ep.name, name, version, ep.value)


def get_plugin_manager(
    only: list[str] | None = None,
    entry_points: list[metadata.EntryPoint] | None = None,
    switches: bool = True,
) -> TitanPluginManager:
    """Build the manager: hookspecs, built-ins, then the enabled installed plugins.

    Disabled plugins are blocked before anything is loaded; a plugin whose import fails, that
    claims a name it may not have, or that implements hooks wrongly or that this core does not
    know, is recorded as failed and left out while the others load. Nothing here raises for a
    plugin's fault (except Ctrl-C, re-raised after the report).

    :param only: an explicit allowlist of entry-point names (``apply(only=...)``).
    :param entry_points: override discovery (tests); defaults to :func:`discover`.
    :param switches: False loads every installed plugin, on or off (``plan`` asks them all).
    """
    pm, planned = import_plan(only, entry_points, switches)
    with _Watchdog() as watchdog:
        for record, ep in planned:
            _load_one(pm, record, ep, watchdog)
    _drop_unknown_hooks(pm)
    _refuse_non_wrappers(pm)
    return pm


def import_plan(
    only: list[str] | None = None,
    entry_points: list[metadata.EntryPoint] | None = None,
    switches: bool = True,
) -> tuple[TitanPluginManager, list[tuple[PluginRecord, metadata.EntryPoint]]]:
    """The manager before any plugin is imported (the core registered, names claimed, disabled
    plugins blocked and recorded) and the plugins it imports next, in order, each with its
    entry point; :func:`get_plugin_manager` loads them, ``titan-plugins doctor --imports``
    replays each import in its own process. Parameters as for :func:`get_plugin_manager`."""
    from titan_plugins import builtin

    pm = TitanPluginManager()
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name=BUILTIN)
    by_name = _claim_names(pm, discover() if entry_points is None else entry_points)
    blocked = disabled_reasons(by_name, only, pm.problems) if switches else {}
    for name, reason in blocked.items():
        pm.set_blocked(name)
        pm.records[name].state, pm.records[name].reason = DISABLED, reason
    planned = [(pm.records[name], ep) for name, ep in by_name.items() if not pm.is_blocked(name)]
    return pm, planned


def _claim_names(
    pm: TitanPluginManager, eps: list[metadata.EntryPoint]
) -> dict[str, metadata.EntryPoint]:
    """Decide which entry point owns each name; record the refused ones (keyed name@dist)."""
    claims: dict[str, list[metadata.EntryPoint]] = {}
    for ep in eps:
        claims.setdefault(ep.name, []).append(ep)
    picks = dict(item.split("=", 1) for item in PICK.read() if "=" in item)
    winners: dict[str, metadata.EntryPoint] = {}
    for name, candidates in claims.items():
        problem = name_problem(name)
        if problem is not None:
            for ep in candidates:
                _refuse(pm, ep, problem)
            continue
        winner = _winner(name, candidates, picks.get(name))
        for ep in candidates:
            if ep is winner:
                continue
            _refuse(pm, ep, _collision_reason(name, ep, candidates, winner))
        if winner is not None:
            winners[name] = winner
            pm.records[name] = _record(winner)
    return winners


def _winner(
    name: str, candidates: list[metadata.EntryPoint], picked: str | None
) -> metadata.EntryPoint | None:
    owner = FIRST_PARTY.get(name)
    if owner is not None:
        own = [ep for ep in candidates if _dist_name(ep) == owner]
        return own[0] if own else None
    if len(candidates) == 1:
        return candidates[0]
    chosen = [ep for ep in candidates if _dist_name(ep) == picked]
    return chosen[0] if len(chosen) == 1 else None


def _collision_reason(
    name: str,
    ep: metadata.EntryPoint,
    candidates: list[metadata.EntryPoint],
    winner: metadata.EntryPoint | None,
) -> str:
    dists = ", ".join(sorted(_dist_name(c) or c.value for c in candidates))
    owner = FIRST_PARTY.get(name)
    if owner is not None:
        return (
            f"the name {name!r} belongs to {owner} (shipped by titan-plugins); "
            f"{_dist_name(ep) or ep.value} may not take it: rename its entry point"
        )
    if winner is not None:
        return f"name {name!r} is also claimed by {dists}; TITAN_PLUGINS_PICK chose {_dist_name(winner)}"
    return (
        f"name {name!r} is claimed by several distributions ({dists}); none loads until you "
        f"pick one: TITAN_PLUGINS_PICK={name}=<distribution>, or uninstall the other"
    )


def _refuse(pm: TitanPluginManager, ep: metadata.EntryPoint, reason: str) -> None:
    record = _record(ep)
    record.state, record.reason = FAILED, reason
    pm.records[f"{ep.name}@{record.distribution or ep.value}"] = record
    logger.warning("plugin %s (%s) refused: %s", ep.name, record.distribution, reason)


class _Watchdog:
    """One daemon thread for the whole loading loop that names a plugin whose import runs
    longer than :data:`SLOW_IMPORT_S` (a thread per plugin cost ~0.5 ms each to start, at every
    activation, i.e. inside every ``import megatron``)."""

    def __init__(self) -> None:
        self._loading: tuple[PluginRecord, float] | None = None
        self._started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="titan-plugin-watchdog")
        self._thread.daemon = True

    def __enter__(self) -> _Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def loading(self, record: PluginRecord | None) -> None:
        """``record`` starts importing now (None: nothing is importing)."""
        self._loading = (record, time.monotonic()) if record is not None else None
        if record is not None and not self._started:
            self._started = True
            self._thread.start()  # only when something loads

    def _watch(self) -> None:
        warned: PluginRecord | None = None
        limit = SLOW_IMPORT_S  # read once: tests shorten it before loading starts
        while not self._stop.wait(limit / 4):
            loading = self._loading
            if loading is None or loading[0] is warned:
                continue
            record, since = loading
            if time.monotonic() - since >= limit:
                warned = record
                try:
                    _still_importing(record, since)
                except Exception:  # a warning must not end the watch of the next plugin
                    pass


def _load_one(
    pm: TitanPluginManager, record: PluginRecord, ep: metadata.EntryPoint, watchdog: _Watchdog
) -> None:
    watchdog.loading(record)
    # named before the import: a plugin that ends the process there (os._exit, a crash in an
    # extension) leaves this line as the last one, and nothing else names it
    logger.debug(
        "importing plugin %s (%s %s, %s); if the process ends here, this plugin ended it "
        "(titan-plugins doctor --imports checks each plugin alone)",
        record.name,
        record.distribution or "unknown distribution",
        record.version,
        record.value,
    )
    try:
        plugin = ep.load()
        pm.register(plugin, name=record.name)
    except BaseException as err:  # a broken plugin must not break import torch or the others
        record.state = FAILED
        if isinstance(err, SystemExit):
            record.reason = f"load failed: the plugin called sys.exit({err.code!r}) at import"
        else:
            record.reason = f"load failed: {type(err).__name__}: {err}"
        logger.warning("plugin %s not loaded: %s", record.name, record.reason)
        if isinstance(err, KeyboardInterrupt):
            raise
        return
    finally:
        watchdog.loading(None)
    record.plugin = plugin


def _still_importing(record: PluginRecord, since: float) -> None:
    logger.warning(
        "plugin %s (%s) is still importing after %.0f s: it may hang this process; "
        "TITAN_PLUGINS_DISABLE=%s skips it",
        record.name,
        record.distribution or record.value,
        time.monotonic() - since,
        record.name,
    )


def _fail_plugin(pm: TitanPluginManager, plugin: object, reason: str) -> None:
    name = pm.get_name(plugin) or "?"
    pm.unregister(plugin)
    record = pm.records.get(name)
    if record is not None:
        record.state, record.reason = FAILED, reason
    logger.warning("plugin %s unregistered: %s", name, reason)


def _drop_unknown_hooks(pm: TitanPluginManager) -> None:
    """Unregister plugins whose hooks this core does not define (newer plugin, older core)."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as err:
            plugin = err.plugin
            unknown = sorted(
                hook
                for hook in dir(pm.hook)
                if hook.startswith("titan_")
                and not pm.hook.__dict__[hook].has_spec()
                and any(impl.plugin is plugin for impl in pm.hook.__dict__[hook].get_hookimpls())
            )
            _fail_plugin(
                pm,
                plugin,
                f"implements hooks this core does not know ({', '.join(unknown)}); "
                "upgrade titan-plugins",
            )


def _refuse_non_wrappers(pm: TitanPluginManager) -> None:
    """The training-loop hooks run Megatron's function in the core: a plugin may only wrap them
    (a plain implementation would replace the schedule or the optimizer step)."""
    for hook in WRAPPER_HOOKS:
        for impl in getattr(pm.hook, hook).get_hookimpls():
            if impl.plugin_name == BUILTIN or impl.wrapper or impl.hookwrapper:
                continue
            if pm.is_registered(impl.plugin):
                _fail_plugin(
                    pm,
                    impl.plugin,
                    f"implements {hook} without wrapper=True; use @hookimpl(wrapper=True) and "
                    "return the result of yield",
                )
