"""Signature checks: what a patch relies on in its target, checked against the imported code.

A version number says little about the code a patch meets: Megatron-LM runs from source
checkouts, slime applies a ~1000-line patch to it, miles forks it and miles-rl bundles its own
0.16.0rc0 copy. A :class:`Signature` states what a patch's replacement actually relies on -
parameter names of the function it wraps, attributes, a source fragment that must (or must not)
be there - and the engine checks it right after the target module executes, before any factory
runs. A target that does not match is ``skipped`` with what differed; it is never half-patched.

Checks read the module that is already imported (``inspect`` on live objects, the source file
read once per file version); nothing is imported here.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import tokenize
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import Any

MODULE = "."  # ``of=MODULE``: the source checks read the whole target module


def _tuple(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class Signature:
    """What a patch relies on in its target module.

    :param of: attribute path inside the target module that ``params`` / ``contains`` /
        ``lacks`` read (``"function"``, ``"Class.method"``, :data:`MODULE` for the whole module);
        empty: the patch's own target.
    :param params: parameter names the function at ``of`` must accept, in this relative order
        (other parameters may sit between them): for replacements that pass keywords.
    :param positional: the function's first parameters, exactly these names at exactly these
        positions: for replacements that read ``args[i]``. ``self`` counts for methods.
    :param attrs: attribute paths that must exist in the target module (``"Class.attr"``).
    :param contains: source fragments the source of ``of`` must contain (whitespace-insensitive;
        a non-function ``of`` is checked in the module's source).
    :param lacks: source fragments it must not contain (e.g. the upstream fix that makes the
        patch unnecessary or wrong).
    """

    of: str = ""
    params: tuple[str, ...] = ()
    positional: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    contains: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("params", "positional", "attrs", "contains", "lacks"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))

    def describe(self, target_attr: str = "") -> str:
        """One line for reports: what this signature expects."""
        where = self.of or target_attr or "target"
        parts = []
        if self.positional:
            parts.append(f"{where}({', '.join(self.positional)}, ...)")
        if self.params:
            parts.append(f"{where}(... {', '.join(self.params)} ...)")
        parts += [f"has {a}" for a in self.attrs]
        parts += [f"{where} contains {c!r}" for c in self.contains]
        parts += [f"{where} lacks {c!r}" for c in self.lacks]
        return "; ".join(parts) or f"{where} exists"

    def mismatch(self, module: ModuleType, target_attr: str) -> str | None:
        """What differs between this signature and ``module``, or None when it matches.

        :param target_attr: the patch's own ``attr`` / ``Class.attr`` (the default ``of``).
        """
        for path in self.attrs:
            if lookup(module, path) is _ABSENT:
                return f"{module.__name__} has no {path}"
        where = self.of or target_attr
        obj = module if where == MODULE else lookup(module, where)
        if obj is _ABSENT:
            if self.params or self.positional or self.contains or self.lacks or not self.attrs:
                return f"{module.__name__} has no {where}"
            return None
        name = module.__name__ if where == MODULE else f"{module.__name__}.{where}"
        if self.params or self.positional:
            reason = _params_mismatch(obj, self.params, self.positional, name)
            if reason:
                return reason
        if self.contains or self.lacks:
            source = _source(obj, module)
            if source is None:
                return f"source of {name} is unavailable"
            for fragment in self.contains:
                if not _has(source, fragment):
                    return f"{name} does not contain {fragment!r}"
            for fragment in self.lacks:
                if _has(source, fragment):
                    return f"{name} contains {fragment!r}"
        return None


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()


def lookup(module: ModuleType, path: str) -> Any:
    """The object at ``Class.attr`` inside ``module`` (class attributes read raw, so a
    staticmethod is seen as defined), or ``_ABSENT``."""
    obj: Any = module
    for part in path.split("."):
        if inspect.isclass(obj):
            for klass in obj.__mro__:
                if part in klass.__dict__:
                    obj = klass.__dict__[part]
                    break
            else:
                return _ABSENT
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return _ABSENT
    return obj


def _function(obj: Any) -> Any:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    return obj


def _params_mismatch(
    obj: Any, expected: tuple[str, ...], positional: tuple[str, ...], name: str
) -> str | None:
    function = _function(obj)
    if not callable(function):
        return f"{name} is not callable"
    try:
        have = list(inspect.signature(function).parameters)  # follows __wrapped__
    except (TypeError, ValueError):
        return f"{name} has no readable signature"
    if tuple(have[: len(positional)]) != positional:
        return f"{name}({', '.join(have)}) does not start with ({', '.join(positional)})"
    missing = [p for p in expected if p not in have]
    if missing:
        return f"{name}({', '.join(have)}) has no parameter {', '.join(map(repr, missing))}"
    positions = [have.index(p) for p in expected]
    if positions != sorted(positions):
        return f"{name}({', '.join(have)}) orders {', '.join(expected)} differently"
    return None


def _source(obj: Any, module: ModuleType) -> str | None:
    target = inspect.unwrap(_function(obj)) if callable(_function(obj)) else None
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        target = module  # a flag or a value: look in the module that defines it
    fast = _fast_source(target)
    if fast is not None:
        return fast
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):
        return None


def _has(source: str, fragment: str) -> bool:
    """Whether ``fragment`` occurs in ``source`` whitespace-insensitively (any run of whitespace
    matches any other), so formatting changes upstream do not fail a check."""
    # Verbatim first: fragments are copied from the upstream source, so this is the usual
    # answer, and it needs no pattern compiled (~0.2 ms each while megatron imports). A verbatim
    # occurrence always matches the pattern, so this never changes an answer.
    return fragment in source or _pattern(fragment).search(source) is not None


@functools.lru_cache(maxsize=256)
def _pattern(fragment: str) -> re.Pattern[str]:
    return re.compile(r"\s+".join(map(re.escape, fragment.split())))


def _fast_source(target: Any) -> str | None:
    """The source of a module or function read straight from its file (cached per file
    version), or None where ``inspect.getsource`` must do it (classes, no file, no code).

    ``inspect.getsource`` tokenizes a function's block and re-reads the module through
    linecache on every call; the engine asks for sources while megatron imports, so the file is
    read once and a function's lines come from its code object (first line, decorators
    included, to the last line any of its code, nested code included, spans).
    """
    if inspect.ismethod(target):
        target = target.__func__
    if isinstance(target, ModuleType):
        path = getattr(target, "__file__", None)
        stamp = _stamp(path)
        return _file_text(path, stamp) if path and stamp is not None else None
    code = getattr(target, "__code__", None)
    if not isinstance(code, CodeType):
        return None
    stamp = _stamp(code.co_filename)
    lines = _file_lines(code.co_filename, stamp) if stamp is not None else None
    if not lines:
        return None
    first, last = code.co_firstlineno, _last_line(code)
    if not 1 <= first <= last <= len(lines):
        return None
    # The code ends before a closing bracket or a trailing comment of the block: extend to the
    # block's end, the last line indented deeper than the ``def`` before the next statement.
    indent = _indent(lines[first - 1])
    def_line = next(
        (i + 1 for i in range(first - 1, last) if lines[i].lstrip().startswith(("def ", "async "))),
        None,
    )
    if def_line is None or last <= def_line:
        return None  # a lambda, or a body the code does not reach past its header (docstring)
    for index in range(last, len(lines)):
        text = lines[index].strip()
        if text and _indent(lines[index]) <= indent:
            break
        if text:
            last = index + 1
    return "".join(lines[first - 1 : last])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _stamp(path: str | None) -> int | None:
    if not path or not path.endswith(".py"):
        return None
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _file_lines(path: str, stamp: int) -> tuple[str, ...] | None:
    try:
        with tokenize.open(path) as fh:  # honours a PEP 263 coding line, as inspect does
            return tuple(fh.readlines())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


@functools.lru_cache(maxsize=64)
def _file_text(path: str, stamp: int) -> str | None:
    lines = _file_lines(path, stamp)
    return "".join(lines) if lines is not None else None


def _last_line(code: CodeType) -> int:
    last = code.co_firstlineno
    for _, end, _, _ in code.co_positions():
        if end is not None and end > last:
            last = end
    for const in code.co_consts:
        if isinstance(const, CodeType):
            last = max(last, _last_line(const))
    return last


def check_all(
    signatures: tuple[Signature, ...], module: ModuleType, target_attr: str
) -> str | None:
    """The first mismatch of ``signatures`` against ``module``, or None."""
    for signature in signatures:
        reason = signature.mismatch(module, target_attr)
        if reason:
            return reason
    return None
