"""Version gates, judged against the code that is actually imported.

A gate such as ``megatron-core>=0.16,<0.17`` names a distribution, but users run Megatron from
a source checkout on ``PYTHONPATH`` (no distribution), from an editable install, from a copy
bundled inside another distribution (miles-rl), or with a checkout shadowing an installed wheel.
So for distributions listed in :data:`VERSION_MODULES` the version is read from the package's
own ``package_info`` (``megatron.core.package_info`` of the imported ``megatron.core``, see
:mod:`~titan_plugins.patching.origin`); distribution metadata is the fallback only for
packages without such a module. The engine judges gates when the target module has executed,
never earlier, and never by importing anything.

Comparison is stdlib-only (the activation path runs inside ``import torch`` in every process; a
missing ``packaging`` there would break every interpreter). A version is compared on its release
numbers. A **pre-release** (``0.16.0rc0``, ``0.17.0.dev1``) whose release numbers satisfy the
gate - a pre-release *of the supported line* - passes only *provisionally*: the engine then
applies the patch only if the patch declares a signature and every signature check passes
(decided by the code, not the number). A pre-release of a release outside the range
(``0.17.0rc0`` for ``<0.17``) fails like the release itself.
"""

from __future__ import annotations

import functools
import re
import sys
from importlib import metadata
from typing import Any, NamedTuple

import titan_plugins.patching.origin as origin
from titan_plugins.hosts import HOSTS

VERSION_MODULES: dict[str, str] = {host.DISTRIBUTION: host.PACKAGE for host in HOSTS.values()}
"""Distribution -> import package whose ``package_info`` holds the version of the code."""

_SPEC = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$")
_CLAUSE = re.compile(r"^(==|!=|>=|<=|>|<|~=)\s*([0-9][0-9A-Za-z.\-+*]*)$")
_PRE = re.compile(r"(a|b|rc|dev|alpha|beta|pre)\d*", re.IGNORECASE)


def version_key(version: str) -> tuple[tuple[int, ...], int]:
    """Sort key: (release numbers, 1 for a final release or 0 for pre/dev/rc)."""
    release, final = _parse(version)
    return release, int(final)


def _parse(version: str) -> tuple[tuple[int, ...], bool]:
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)(.*)$", version)
    if not match:
        raise ValueError(f"unparseable version {version!r}")
    release = tuple(int(p) for p in match.group(1).split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    suffix = match.group(2).split("+", 1)[0]
    return release, not _PRE.search(suffix)


def is_prerelease(version: str) -> bool:
    """``0.16.0rc0``, ``0.17.0.dev1``: True; ``0.16.1``, ``2.13.0+cpu``, ``1.0.post1``: False."""
    return not _parse(version)[1]


def _satisfies(version: str, op: str, bound: str) -> bool:
    if op in ("==", "!=") and bound.endswith(".*"):
        prefix = tuple(int(p) for p in bound[:-2].split("."))
        hit = _parse(version)[0][: len(prefix)] == prefix
        return hit if op == "==" else not hit
    # A final bound compares release numbers only (a pre-release is judged by its release and
    # then flagged provisional by the caller); a pre-release bound compares the whole key.
    if is_prerelease(bound):
        have, want = version_key(version), version_key(bound)
    else:
        have, want = (_parse(version)[0], 1), (_parse(bound)[0], 1)
    if op == "~=":
        upper = want[0][:-1]
        return have >= want and have[0][: len(upper)] == upper
    return {
        "==": have == want,
        "!=": have != want,
        ">=": have >= want,
        "<=": have <= want,
        ">": have > want,
        "<": have < want,
    }[op]


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None (read from metadata, no import)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def resolve_version(distribution: str) -> tuple[str | None, str]:
    """Version of ``distribution``'s code and where it was read.

    :return: ``(version or None, source)``; ``source`` names the ``package_info`` file for
        packages in :data:`VERSION_MODULES`, else ``"metadata"``.
    """
    package = VERSION_MODULES.get(origin.normalize(distribution))
    if package is not None:
        # The engine asks once per patch while megatron imports: keep the answer for as long as
        # the same package and package_info modules are the imported ones.
        key = _imported(package)
        known = _RESOLVED.get(package)
        if key is not None and known is not None and known[0] == key:
            return known[1]
        directory = origin.package_dir(package)
        if directory is not None:
            version = origin.code_version(package, directory)
            if version is not None:
                answer = version, f"{package}.package_info at {directory}"
                if key is not None:
                    _RESOLVED[package] = (key, answer)
                return answer
            # a package without package_info: fall back to the distribution's metadata
    return installed_version(distribution), "metadata"


_RESOLVED: dict[str, tuple[tuple[Any, ...], tuple[str | None, str]]] = {}


def _imported(package: str) -> tuple[Any, ...] | None:
    """What identifies the imported ``package`` and its ``package_info`` (None: not both
    imported): the objects, where they were loaded from and the version they hold, so a reload
    from other code, or of an edited file, is never answered from the cache."""
    module, info = sys.modules.get(package), sys.modules.get(f"{package}.package_info")
    if module is None or info is None:
        return None
    path = tuple(getattr(module, "__path__", None) or (getattr(module, "__file__", None),))
    version = getattr(info, "__version__", None)
    return id(module), path, id(info), getattr(info, "__file__", None), version


class Verdict(NamedTuple):
    """Outcome of a patch's gates.

    :param reason: why a gate does not hold; None when every gate holds.
    :param provisional: non-empty when a gate holds only by release number (a pre-release of
        the supported line): the patch must then pass its signature checks.
    """

    reason: str | None = None
    provisional: str = ""


def judge(requirement: str) -> Verdict:
    """Judge one gate such as ``megatron-core>=0.16,<0.17`` against the imported code."""
    match = _SPEC.match(requirement)
    if not match:
        return Verdict(f"malformed version gate {requirement!r}")
    version, source = resolve_version(match.group(1))
    return judge_version(requirement, version, "" if source == "metadata" else source)


@functools.lru_cache(maxsize=256)
def judge_version(requirement: str, version: str | None, where: str = "") -> Verdict:
    """Judge ``requirement`` against a given ``version`` (None: not installed).

    :param where: where the version was read, shown in the reason.
    """
    match = _SPEC.match(requirement)
    if not match:
        return Verdict(f"malformed version gate {requirement!r}")
    name, spec = match.group(1), match.group(2).strip()
    where = f" ({where})" if where else ""
    if version is None:
        return Verdict(f"{name} is not installed (gate {requirement})")
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        parsed = _CLAUSE.match(clause)
        if not parsed:
            return Verdict(f"malformed clause {clause!r} in version gate {requirement!r}")
        try:
            ok = _satisfies(version, parsed.group(1), parsed.group(2))
        except ValueError as err:
            return Verdict(f"{requirement}: {err}")
        if not ok:
            return Verdict(f"{name} {version}{where} is outside {spec}")
    if is_prerelease(version):
        return Verdict(provisional=f"{name} {version}{where} is a pre-release of {spec}")
    return Verdict()


def judge_all(requirements: tuple[str, ...]) -> Verdict:
    """Every gate of a patch: the first failure, else the first provisional pass, else a pass."""
    provisional = ""
    for requirement in requirements:
        verdict = judge(requirement)
        if verdict.reason:
            return verdict
        provisional = provisional or verdict.provisional
    return Verdict(provisional=provisional)


def other_line(requirements: tuple[str, ...]) -> str | None:
    """When a patch's gates fail only because it was written for another *supported* line of
    its host (a variant: the imported line has its own record), say so; else None.

    Only a host's line gates count (``LINE_GATES``: Megatron's ``megatron_lines``), and only
    while the imported code is inside that host's ``SUPPORTED`` range: any other failing gate
    is a real skip.
    """
    failing = [r for r in requirements if judge(r).reason]
    if not failing:
        return None
    for host in HOSTS.values():
        if any(r not in host.LINE_GATES for r in failing):
            continue
        if judge(host.SUPPORTED).reason:
            return None
        version, _ = resolve_version(host.DISTRIBUTION)
        matches = [_SPEC.match(r) for r in failing]
        spans = "; ".join(m.group(2).strip() for m in matches if m is not None)
        return f"written for {host.DISTRIBUTION} {spans}; this is {version}"
    return None


def check(requirement: str) -> str | None:
    """Check one gate; None when it holds (provisionally included), else the reason."""
    return judge(requirement).reason


def check_all(requirements: tuple[str, ...]) -> str | None:
    """Check every gate; return the first failure reason or None."""
    return judge_all(requirements).reason
