"""The patch engine: ordered, idempotent, all-or-nothing per target, undoable, reported."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import titan_plugins.patching.gates as gates
import titan_plugins.patching.signature as signature
import titan_plugins.patching.targets as targets
from titan_plugins._log import logger
from titan_plugins.hosts import HOSTS
from titan_plugins.patching.record import MISSING, Patch
from titan_plugins.patching.status import APPLIED, FAILED, OTHER_LINE, PENDING, SKIPPED
from titan_plugins.settings import strict

# Where copies of a patched target may live: the packages of every host (``megatron.``).
ALIAS_PREFIXES = tuple(f"{p}." for host in HOSTS.values() for p in host.TRIGGER_PREFIXES)


class PatchError(RuntimeError):
    """A patch failed, or its version gate or signature did not hold, under
    TITAN_PLUGINS_STRICT=1."""


class _Target:
    """All patches of one ``module:attr`` and what the engine did to it."""

    # A plain class: a dataclass costs ~1 ms to build inside every ``import megatron``.
    def __init__(self, key: str, module_name: str) -> None:
        self.key = key
        self.module_name = module_name  # the module whose execution triggers these patches
        self.patches: list[Patch] = []
        self.patched_module: ModuleType | None = None  # the module the chain was applied in
        self.owner: Any = None
        self.attr = ""
        self.baseline: Any = MISSING
        self.applied: Any = MISSING
        self.aliases: list[tuple[ModuleType, str]] = []

    @property
    def is_applied(self) -> bool:
        return self.patched_module is not None


class PatchEngine:
    """Holds patch records and applies them when (or once) their modules have executed."""

    def __init__(self) -> None:
        self._targets: dict[str, _Target] = {}
        self._ids: dict[str, Patch] = {}
        self._order: list[str] = []
        # The watcher consults these on every import in the process: keep them O(1).
        self._watched: set[str] = set()
        self.deferred: set[str] = set()  # imported but still executing when we wanted to patch
        self._skips_logged: set[str] = set()  # plugins whose first skip was logged as a warning
        self.apply_seconds = 0.0  # spent judging and applying patches (activation overhead)

    # ---------------------------------------------------------------- registration
    def register(self, patch: Patch, plugin: str = "") -> None:
        """Add a record; apply it at once if its module is already imported.

        Version gates and signatures are judged when the module has executed (here, if it
        already has), against the imported code.

        :raises ValueError: a duplicate patch id.
        """
        if patch.id in self._ids:
            raise ValueError(f"duplicate patch id {patch.id!r}")
        patch.plugin = plugin or patch.plugin
        self._ids[patch.id] = patch
        target = self._targets.get(patch.target)
        if target is None:
            target = self._targets[patch.target] = _Target(patch.target, patch.module)
            self._order.append(patch.target)
        if target.is_applied:
            self._unapply(target)  # re-apply the whole chain with the newcomer at its end
        target.patches.append(patch)
        self._watched.add(patch.module)
        self.apply_module_if_ready(patch.module)

    def withdraw(self, plugin: str) -> None:
        """Remove (and undo) every patch of ``plugin``; used when its registration failed."""
        for key in list(self._order):
            target = self._targets[key]
            if not any(p.plugin == plugin for p in target.patches):
                continue
            if target.is_applied:
                self._unapply(target)
            target.patches = [p for p in target.patches if p.plugin != plugin]
            self.apply_module_if_ready(target.module_name)
        for pid in [pid for pid, p in self._ids.items() if p.plugin == plugin]:
            del self._ids[pid]
        self._watched = {t.module_name for t in self._targets.values() if t.patches}

    # ---------------------------------------------------------------- queries
    def patches(self) -> list[Patch]:
        """Every registered record, in registration order."""
        return list(self._ids.values())

    def pending_modules(self) -> set[str]:
        """Modules with patches still waiting for the module to execute."""
        return {
            t.module_name
            for t in self._targets.values()
            if any(p.status == PENDING for p in t.patches)
        }

    def watched_modules(self) -> set[str]:
        """Modules whose (re-)execution must be followed by patching."""
        return self._watched

    def import_pending(self, importer: Callable[[str], object] = importlib.import_module) -> None:
        """Import every module with pending patches (``titan-plugins list --import-targets``);
        a module that cannot be imported leaves its patches skipped (optional) or failed."""
        for name in sorted(self.pending_modules()):
            try:
                importer(name)
            except Exception as err:  # report, never crash the caller
                reason = f"import {name} failed: {type(err).__name__}: {err}"
                for patch in self._ids.values():
                    if patch.module == name and patch.status == PENDING:
                        elsewhere = gates.other_line(patch.requires)
                        if elsewhere is not None:  # a module of another line
                            patch.set_status(OTHER_LINE, elsewhere)
                        else:
                            patch.set_status(SKIPPED if patch.optional else FAILED, reason)

    # ---------------------------------------------------------------- application
    def apply_module_if_ready(self, name: str) -> None:
        """Apply the targets of ``name`` if that module has finished executing."""
        module = targets.module_ready(name)
        if module is not None:
            self.deferred.discard(name)
            self.apply_module(module, fresh=False)
        elif name in sys.modules:
            self.deferred.add(name)

    def retry_deferred(self) -> None:
        """Apply the targets of modules that were still executing at activation, once done."""
        for name in list(self.deferred):
            self.apply_module_if_ready(name)

    def apply_ready(self) -> None:
        """Apply every target whose module has already executed (late activation, retries)."""
        for name in self.pending_modules():
            self.apply_module_if_ready(name)

    def apply_module(self, module: ModuleType, fresh: bool) -> None:
        """Apply every target of ``module``.

        :param fresh: the module body just executed (post-exec hook or reload): its attributes
            are originals, so any earlier application is forgotten, and no alias can exist yet.
        """
        started = time.perf_counter()
        try:
            self._apply_module(module, fresh)
        finally:
            self.apply_seconds += time.perf_counter() - started

    def _apply_module(self, module: ModuleType, fresh: bool) -> None:
        for key in self._order:
            target = self._targets[key]
            if target.module_name != module.__name__:
                continue
            if fresh:  # new code: judge every patch again (a reload may bring other code)
                target.patched_module, target.aliases = None, []
                for patch in target.patches:
                    if patch.status in (SKIPPED, OTHER_LINE):
                        patch.set_status(PENDING)
            self._apply_target(target, module, fresh)

    def _apply_target(self, target: _Target, module: ModuleType, fresh: bool) -> None:
        if target.is_applied:
            active = [p for p in target.patches if p.status != SKIPPED]
            current, _ = targets.read_raw(target.owner, target.attr)
            if target.patched_module is module and current is target.applied:
                return  # idempotent: already ours
            if active:
                self._fail(active, "target changed outside the engine since it was patched")
            return
        active = self._judge([p for p in target.patches if p.status != SKIPPED], module)
        if not active:
            return
        try:
            owner, attr = targets.resolve_owner(module, active[0].attr_path)
        except AttributeError as err:
            self._missing(active, f"{err}")
            return
        baseline, _ = targets.read_raw(owner, attr)
        if baseline is MISSING and not all(p.create for p in active):
            self._missing([p for p in active if not p.create], f"{module.__name__} has no {attr!r}")
            return
        value = baseline
        for patch in active:
            try:
                value = patch.replace(value)
            except Exception as err:  # a plugin bug must not break the host's import
                self._fail(active, f"rolled back: {patch.id} raised {type(err).__name__}: {err}")
                patch.set_status(FAILED, f"replace() raised {type(err).__name__}: {err}")
                return
        try:
            targets.write(owner, attr, value)
        except Exception as err:
            self._fail(active, f"could not set {target.key}: {err}")
            return
        target.patched_module, target.owner, target.attr = module, owner, attr
        target.baseline, target.applied = baseline, value
        if not fresh and active[0].rebind_aliases and baseline is not MISSING and owner is module:
            target.aliases = targets.find_aliases(baseline, ALIAS_PREFIXES, skip=module)
            for alias_module, alias in target.aliases:
                setattr(alias_module, alias, value)
        for patch in active:
            patch.set_status(
                APPLIED, "late (module imported before activation)" if not fresh else ""
            )
            logger.debug("applied %s -> %s", patch.id, target.key)

    def _judge(self, patches: list[Patch], module: ModuleType) -> list[Patch]:
        """Skip the patches whose gates or signatures do not hold; return the others.

        Runs before any factory, so a target that does not match is never half-patched.
        """
        kept: list[Patch] = []
        for patch in patches:
            elsewhere = gates.other_line(patch.requires)
            if elsewhere is not None:  # by design: not a skip, not a STRICT problem
                patch.set_status(OTHER_LINE, elsewhere)
                logger.debug("patch %s not applied: %s", patch.id, elsewhere)
                continue
            reason = skip_reason(patch, module)
            if reason is None:
                kept.append(patch)
                continue
            patch.set_status(SKIPPED, reason)
            self._log_skip(patch, reason)
            if strict():
                raise PatchError(f"patch {patch.id}: {reason} (TITAN_PLUGINS_STRICT=1)")
        return kept

    def _log_skip(self, patch: Patch, reason: str) -> None:
        """One warning per plugin (an unsupported Megatron skips every patch of a plugin: one
        line each would bury the job's output); the rest at debug level, all in the report."""
        if patch.plugin in self._skips_logged:
            logger.debug("patch %s skipped: %s", patch.id, reason)
            return
        self._skips_logged.add(patch.plugin)
        logger.warning(
            "plugin %s: patch %s skipped: %s (later skips of this plugin are logged at debug "
            "level; `titan-plugins list --import-targets` shows every patch)",
            patch.plugin or "?",
            patch.id,
            reason,
        )

    def _missing(self, patches: list[Patch], reason: str) -> None:
        for patch in patches:
            elsewhere = gates.other_line(patch.requires)
            if elsewhere is not None:  # a variant for another line: its target may not exist here
                patch.set_status(OTHER_LINE, elsewhere)
            elif patch.optional:
                patch.set_status(SKIPPED, f"target absent: {reason}")
            else:
                patch.set_status(FAILED, f"target absent: {reason}")
        self._report_failures(patches)

    def _fail(self, patches: list[Patch], reason: str) -> None:
        for patch in patches:
            patch.set_status(FAILED, reason)
        self._report_failures(patches)

    def _report_failures(self, patches: list[Patch]) -> None:
        failed = [p for p in patches if p.status == FAILED]
        for patch in failed:
            logger.warning("patch %s failed: %s", patch.id, patch.detail)
        if failed and strict():
            raise PatchError(
                f"patch {failed[0].id} failed: {failed[0].detail} (TITAN_PLUGINS_STRICT=1)"
            )

    # ---------------------------------------------------------------- undo
    def undo(self) -> list[str]:
        """Restore every target that is still ours, newest first.

        :return: the targets left alone because something else rebound them after us.
        """
        left: list[str] = []
        for key in reversed(self._order):
            target = self._targets[key]
            if target.is_applied and not self._unapply(target):
                left.append(key)
        return left

    def _unapply(self, target: _Target) -> bool:
        current, _ = targets.read_raw(target.owner, target.attr)
        ours = current is target.applied
        if ours:
            targets.write(target.owner, target.attr, target.baseline)
        for module, alias in target.aliases:
            if getattr(module, alias, None) is target.applied:
                setattr(module, alias, target.baseline)
        for patch in target.patches:
            if patch.status == APPLIED:
                patch.set_status(
                    PENDING, "undone" if ours else "not restored: rebound by someone else"
                )
        target.patched_module, target.owner, target.aliases = None, None, []
        target.applied = MISSING
        return ours


def skip_reason(patch: Patch, module: ModuleType) -> str | None:
    """Why ``patch`` must not be applied to the executed ``module``, or None.

    Gates read the version of the imported code; a pre-release of the supported line passes
    only through the patch's signature checks (a patch without a signature is skipped then).
    """
    verdict = gates.judge_all(patch.requires)
    if verdict.reason:
        return f"version gate: {verdict.reason}"
    if patch.signature:
        mismatch = signature.check_all(patch.signature, module, patch.attr_path)
        if mismatch:
            return f"signature: {mismatch}"
    elif verdict.provisional:
        return f"version gate: {verdict.provisional}; the patch declares no signature to check"
    return None
