"""Resolve and rebind ``module:attr`` / ``module:Class.attr`` targets without importing."""

from __future__ import annotations

import inspect
import sys
from types import ModuleType
from typing import Any

from titan_plugins.patching.record import MISSING


def module_ready(name: str) -> ModuleType | None:
    """The module if it is imported and has finished executing, else None.

    During ``import megatron.core`` the torch.backends hook runs while some megatron modules
    are still executing; patching those would miss attributes not yet defined.
    """
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return module


def resolve_owner(module: ModuleType, attr_path: str) -> tuple[Any, str]:
    """Walk ``Class.attr`` inside ``module``; return (owner object, final attribute name).

    :raises AttributeError: when an intermediate name is missing.
    """
    *parents, leaf = attr_path.split(".")
    owner: Any = module
    for name in parents:
        owner = getattr(owner, name)
    return owner, leaf


def read_raw(owner: Any, attr: str) -> tuple[Any, bool]:
    """Current value of ``owner.attr`` and whether the owner defines it itself.

    For classes the raw ``__dict__`` entry is used so staticmethod / classmethod descriptors
    survive a patch and its undo unchanged.
    """
    if inspect.isclass(owner):
        if attr in owner.__dict__:
            return owner.__dict__[attr], True
        return getattr(owner, attr, MISSING), False
    if hasattr(owner, attr):
        return getattr(owner, attr), True
    return MISSING, False


def write(owner: Any, attr: str, value: Any) -> None:
    """Set ``owner.attr = value``; ``MISSING`` deletes the attribute."""
    if value is MISSING:
        if attr in getattr(owner, "__dict__", {}):
            delattr(owner, attr)
        return
    setattr(owner, attr, value)


def find_aliases(
    original: Any, prefixes: tuple[str, ...], skip: ModuleType
) -> list[tuple[ModuleType, str]]:
    """Module-level names bound to ``original`` by ``from x import f`` in modules under ``prefixes``.

    Only functions and classes are rebound: a copied flag or number may have been meant to
    diverge from its source.
    """
    if not (
        inspect.isfunction(original) or inspect.isclass(original) or inspect.isbuiltin(original)
    ):
        return []
    hits: list[tuple[ModuleType, str]] = []
    for name, module in list(sys.modules.items()):
        if module is None or module is skip or not name.startswith(prefixes):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                hits.append((module, attr))
    return hits
