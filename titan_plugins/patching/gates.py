"""Version gates read from distribution metadata, with a stdlib-only comparison.

The activation path runs inside ``import torch`` in every process, so it must not depend on
``packaging`` (a missing dependency there would break every interpreter in the environment).
Versions are compared on their release numbers; a pre-release or dev suffix sorts before the
release it precedes, which is what gates such as ``>=0.16,<0.17`` need.
"""

from __future__ import annotations

import re
from importlib import metadata

_SPEC = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$")
_CLAUSE = re.compile(r"^(==|!=|>=|<=|>|<|~=)\s*([0-9][0-9A-Za-z.\-+*]*)$")


def version_key(version: str) -> tuple[tuple[int, ...], int]:
    """Sort key: (release numbers, 1 for a final release or 0 for pre/dev/rc)."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)(.*)$", version)
    if not match:
        raise ValueError(f"unparseable version {version!r}")
    release = tuple(int(p) for p in match.group(1).split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    suffix = match.group(2).split("+", 1)[0]
    is_final = not re.search(r"(a|b|rc|dev|alpha|beta|pre)\d*", suffix, re.IGNORECASE)
    return release, int(is_final)


def _satisfies(version: str, op: str, bound: str) -> bool:
    if op in ("==", "!=") and bound.endswith(".*"):
        prefix = tuple(int(p) for p in bound[:-2].split("."))
        hit = version_key(version)[0][: len(prefix)] == prefix
        return hit if op == "==" else not hit
    have, want = version_key(version), version_key(bound)
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


def check(requirement: str) -> str | None:
    """Check one gate such as ``megatron-core>=0.16,<0.17``.

    :return: None when satisfied, otherwise the reason it is not.
    """
    match = _SPEC.match(requirement)
    if not match:
        return f"malformed version gate {requirement!r}"
    name, spec = match.group(1), match.group(2).strip()
    version = installed_version(name)
    if version is None:
        return f"{name} is not installed (gate {requirement})"
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        parsed = _CLAUSE.match(clause)
        if not parsed:
            return f"malformed clause {clause!r} in version gate {requirement!r}"
        try:
            ok = _satisfies(version, parsed.group(1), parsed.group(2))
        except ValueError as err:
            return f"{requirement}: {err}"
        if not ok:
            return f"{name} {version} is outside {spec}"
    return None


def check_all(requirements: tuple[str, ...]) -> str | None:
    """Check every gate; return the first failure reason or None."""
    for requirement in requirements:
        reason = check(requirement)
        if reason:
            return reason
    return None
