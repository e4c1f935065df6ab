"""Signature source checks read sources straight from the files (cached per file version) rather
than through ``inspect.getsource``; what they read must be what ``inspect`` reads, up to
whitespace, and a gate's version is re-read whenever the imported code changes."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import types

import pytest

from titan_plugins.patching import gates, signature
from titan_plugins.patching.signature import MODULE, Signature


def _squash(text: str) -> str:
    """What the checks compare: runs of whitespace made one space."""
    return " ".join(text.split())


def _functions(module: types.ModuleType) -> list:
    found = []
    for value in vars(module).values():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            found.append(value)
        if inspect.isclass(value) and value.__module__ == module.__name__:
            found += [f for f in vars(value).values() if inspect.isfunction(f)]
    return [inspect.unwrap(f) for f in found]


@pytest.mark.parametrize(
    "module_name",
    [
        "argparse",
        "json.decoder",
        "inspect",
        "titan_plugins.patching.engine",
        "titan_plugins.settings",
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.transformer.moe.moe_layer",
    ],
)
def test_function_sources_match_inspect_up_to_whitespace(module_name: str) -> None:
    module = importlib.import_module(module_name)
    fast = fallback = 0
    for function in _functions(module):
        try:
            expected = _squash(inspect.getsource(function))
        except (OSError, TypeError):
            continue
        got = signature._fast_source(function)
        if got is None:  # left to inspect (e.g. a body that is only a docstring)
            fallback += 1
            continue
        assert _squash(got) == expected, function.__qualname__
        fast += 1
    assert fast > 0 and fallback <= fast // 10, (fast, fallback)


def test_module_source_is_the_file() -> None:
    assert signature._fast_source(argparse) == inspect.getsource(argparse)
    assert signature._fast_source(json) == inspect.getsource(json)


@pytest.mark.parametrize(
    ("fragment", "present"),
    [
        ("def _get_values(self, action, arg_strings)", True),
        ("def   _get_values(self,\n   action, arg_strings)", True),  # whitespace-insensitive
        ("def _get_values(self, action, arg_strings) [", False),  # regex characters are literal
        ("_get_values(self,action", False),  # whitespace must be there
        ("", True),
    ],
)
def test_contains_ignores_whitespace_only(fragment: str, present: bool) -> None:
    source = inspect.getsource(argparse)
    assert signature._has(source, fragment) is present
    assert (_squash(fragment) in _squash(source)) is present  # same rule
    reason = Signature(of=MODULE, contains=(fragment,)).mismatch(argparse, "")
    assert (reason is None) is present


def test_a_reloaded_package_info_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("titan_fake_versioned")
    package.__path__ = ["/nowhere/titan_fake_versioned"]
    info = types.ModuleType("titan_fake_versioned.package_info")
    info.__file__ = "/nowhere/titan_fake_versioned/package_info.py"
    info.__version__ = "1.2.0"
    monkeypatch.setitem(sys.modules, "titan_fake_versioned", package)
    monkeypatch.setitem(sys.modules, "titan_fake_versioned.package_info", info)
    monkeypatch.setitem(gates.VERSION_MODULES, "titan-fake-versioned", "titan_fake_versioned")
    monkeypatch.setattr(gates.origin, "package_dir", lambda name: __import__("pathlib").Path(
        "/nowhere/titan_fake_versioned"))  # fmt: skip
    assert gates.resolve_version("titan-fake-versioned")[0] == "1.2.0"
    assert gates.judge("titan-fake-versioned>=1.2,<1.3").reason is None
    info.__version__ = "1.3.0"  # reloaded in place from edited code: same module object
    assert gates.resolve_version("titan-fake-versioned")[0] == "1.3.0"
    assert "outside" in (gates.judge("titan-fake-versioned>=1.2,<1.3").reason or "")
