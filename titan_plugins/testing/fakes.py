"""Fake distributions and entry points, for discovery tests without installing anything (in
this process: :func:`fake_entry_point`; on disk, for processes a test starts:
:func:`write_dist_info`)."""

from __future__ import annotations

import sys
import types
from importlib import metadata
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any


class FakeDistribution:
    """The few ``importlib.metadata.Distribution`` attributes discovery reads."""

    def __init__(self, name: str, version: str = "0.0.1") -> None:
        self.name = name
        self.version = version
        self.metadata = {"Name": name, "Version": version}


def fake_module(name: str, **attrs: Any) -> types.ModuleType:
    """Create and register an importable in-memory module holding ``attrs``."""
    module = types.ModuleType(name)
    module.__spec__ = ModuleSpec(name, None)  # importlib.util.find_spec needs one
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def fake_entry_point(
    name: str,
    value: str,
    distribution: str = "",
    version: str = "0.0.1",
    group: str = "titan_plugins",
) -> metadata.EntryPoint:
    """An entry point of ``group`` whose ``.dist`` is a :class:`FakeDistribution`."""
    ep = metadata.EntryPoint(name=name, value=value, group=group)
    dist = FakeDistribution(distribution or f"fake-{name}", version)
    try:
        return ep._for(dist)  # type: ignore[attr-defined]  # how importlib binds .dist
    except AttributeError:  # pragma: no cover - older importlib
        object.__setattr__(ep, "dist", dist)
        return ep


def write_dist_info(
    root: Path, distribution: str, plugins: dict[str, str], version: str = "0.1"
) -> Path:
    """A ``<distribution>-<version>.dist-info`` folder in ``root`` whose ``titan_plugins`` entry
    points are ``plugins`` (name -> module): with ``root`` on ``sys.path`` (or ``PYTHONPATH``,
    for processes a test starts) discovery finds them as installed plugins."""
    info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    )
    lines = "".join(f"{name} = {module}\n" for name, module in plugins.items())
    (info / "entry_points.txt").write_text(f"[titan_plugins]\n{lines}")
    return info
