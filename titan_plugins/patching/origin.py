"""Where a package came from: the code that is (or would be) imported, its version, its origin.

Megatron reaches users as a ``megatron-core`` wheel, an editable install of a Megatron-LM
checkout, a bare checkout on ``PYTHONPATH`` (no distribution at all), or a copy bundled inside
another distribution (miles-rl ships its own ``megatron/``). Distribution metadata describes
none of the last three, and is wrong when a checkout shadows an installed wheel. This module
looks at the code instead: the package's directory (from ``sys.modules`` when imported, else
from the import system's finders), the version written in its ``package_info.py`` (read
statically), and which installed distribution, if any, owns those files.

Nothing here imports the package itself (a namespace parent such as ``megatron`` may be
located); it is safe for the CLI and for the patch engine while Megatron is importing.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

DISTRIBUTION, EDITABLE, CHECKOUT, BUNDLED, ABSENT = (
    "distribution",
    "editable",
    "checkout",
    "bundled",
    "absent",
)


class Origin(NamedTuple):
    """Where ``package`` comes from in this environment.

    :param kind: ``distribution`` (files installed by the distribution of that name),
        ``editable`` (an editable install's source tree), ``checkout`` (a source tree on
        ``sys.path`` that no distribution owns), ``bundled`` (files installed by another
        distribution) or ``absent``.
    :param distribution: ``"name version"`` of the owning distribution, if any.
    :param shadowed: installed copies of the package that are *not* the one imported
        (``"megatron-core 0.15.0 at /site-packages/megatron/core"``).
    """

    package: str
    path: str | None
    version: str | None
    kind: str
    imported: bool
    distribution: str | None = None
    shadowed: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        return {**self._asdict(), "shadowed": list(self.shadowed)}

    def summary(self, shadows: bool = True) -> str:
        """One line: ``megatron.core 0.16.1 at <path> (checkout on sys.path, no distribution)``,
        followed by the copies it shadows unless ``shadows=False``."""
        if self.kind == ABSENT:
            return f"{self.package}: not importable here"
        how = {
            DISTRIBUTION: f"distribution {self.distribution}",
            EDITABLE: f"editable install of {self.distribution}",
            CHECKOUT: "source checkout on sys.path, no distribution",
            BUNDLED: f"bundled in distribution {self.distribution}",
        }[self.kind]
        line = (
            f"{self.package} {self.version or '(no package_info version)'} at {self.path} ({how})"
        )
        for other in self.shadowed if shadows else ():
            line += f"; shadows {other}"
        return line


def package_dir(package: str) -> Path | None:
    """Directory of ``package`` as imported (or as the next import would find it), or None."""
    module = sys.modules.get(package)
    locations: list[str] = []
    if module is not None:
        locations = list(getattr(module, "__path__", None) or [])
        if not locations and getattr(module, "__file__", None):
            locations = [str(Path(module.__file__).parent)]
    else:
        try:
            spec = importlib.util.find_spec(package)  # may import a namespace parent, never this
        except (ImportError, ValueError, AttributeError):
            spec = None
        if spec is not None:
            locations = list(spec.submodule_search_locations or [])
            if not locations and spec.origin:
                locations = [str(Path(spec.origin).parent)]
    return Path(locations[0]) if locations else None


def read_package_info(path: Path) -> str | None:
    """The version written in ``path`` (a ``package_info.py``), read without executing it.

    Understands megatron's layout (``MAJOR``/``MINOR``/``PATCH``/``PRE_RELEASE``) and a literal
    ``__version__``. Cached per file and modification time (the engine asks once per patch).
    """
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    return _parse_package_info(str(path), stamp)


@functools.lru_cache(maxsize=32)
def _parse_package_info(path: str, stamp: int) -> str | None:
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    if isinstance(values.get("__version__"), str):
        return values["__version__"]
    if all(isinstance(values.get(k), int) for k in ("MAJOR", "MINOR", "PATCH")):
        pre = values.get("PRE_RELEASE") or ""
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{pre}"
    return None


def code_version(package: str, directory: Path | None = None) -> str | None:
    """``<package>.package_info`` version of the imported (or importable) ``package``."""
    directory = directory or package_dir(package)
    if directory is None:
        return None
    loaded = sys.modules.get(f"{package}.package_info")
    loaded_file = getattr(loaded, "__file__", None)
    if loaded_file and Path(loaded_file).parent == directory:
        version = getattr(loaded, "__version__", None)
        if isinstance(version, str):
            return version
    return read_package_info(directory / "package_info.py")


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


def _editable_source(dist: metadata.Distribution) -> Path | None:
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return None
    url = info.get("url", "")
    if not (info.get("dir_info") or {}).get("editable") or not url.startswith("file://"):
        return None
    return Path(url[len("file://") :])


def normalize(name: str) -> str:
    """PEP 503 form of a distribution name (``Megatron_Core`` -> ``megatron-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _label(dist: metadata.Distribution) -> str:
    return f"{dist.metadata['Name']} {dist.version}"


def describe(package: str, distribution: str) -> Origin:
    """Where ``package`` comes from: path, version (from its code), kind, shadowed copies.

    :param package: e.g. a host's ``PACKAGE`` (``megatron.core``).
    :param distribution: the distribution that normally ships ``package``; files owned by any
        other distribution are ``bundled``.
    """
    directory = package_dir(package)
    imported = package in sys.modules
    if directory is None:
        return Origin(package, None, None, ABSENT, imported)
    version = code_version(package, directory)
    init = directory / "__init__.py"
    relative = "/".join(package.split(".")) + "/__init__.py"
    owners: list[tuple[str, str]] = []
    editable: str | None = None
    shadowed: list[str] = []
    for dist in metadata.distributions():
        record = dist.read_text("RECORD") or ""
        if relative in record:
            installed = Path(str(dist.locate_file(relative)))
            if _same(installed, init):
                owners.append((normalize(dist.metadata["Name"]), _label(dist)))
            elif installed.exists():
                shadowed.append(f"{_label(dist)} at {installed.parent}")
            continue
        source = _editable_source(dist)
        if source is not None and (source / relative).exists():
            if directory.resolve().is_relative_to(source.resolve()):
                editable = f"{_label(dist)} ({source})"
            else:
                shadowed.append(
                    f"{_label(dist)} (editable) at {source / package.replace('.', '/')}"
                )
    if owners:
        main = [label for name, label in owners if name == normalize(distribution)]
        kind = DISTRIBUTION if main else BUNDLED
        owner = ", ".join(main or [label for _, label in owners])
        return Origin(package, str(directory), version, kind, imported, owner, tuple(shadowed))
    if editable:
        return Origin(
            package, str(directory), version, EDITABLE, imported, editable, tuple(shadowed)
        )
    return Origin(package, str(directory), version, CHECKOUT, imported, None, tuple(shadowed))
