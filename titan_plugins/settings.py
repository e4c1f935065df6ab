"""Typed environment knobs: each declared once, as the reader of its own value.

A plugin lists its knobs as :class:`Setting` records in its ``settings.py`` (``SETTINGS``) and
returns them from ``titan_settings``; the code reads a knob only through :meth:`Setting.read`,
so the default, the type, the accepted values and the documentation live in one place. The
environment is read at call time (a process that imported us during ``import torch`` is not
always the one that decides). A malformed value (anything the reader cannot turn into a finite
value of its type: overflow, ``nan``, a 401-digit size, or a ``validate`` that raises) warns with
the variable, the value (shortened when long) and what is accepted, and the default is used; under ``TITAN_PLUGINS_STRICT=1`` it raises
:class:`SettingError`. The core checks every enabled plugin's settings at activation
(:func:`problems`), so a bad value is reported before the first step, not at first use.
"""

from __future__ import annotations

import contextlib
import math
import os
import string
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from titan_plugins._log import logger

# re-exported: plugins and the core import these from here
from titan_plugins.values import INT64_MAX as INT64_MAX
from titan_plugins.values import describe_bytes as describe_bytes
from titan_plugins.values import format_bytes as format_bytes
from titan_plugins.values import parse_bytes as parse_bytes
from titan_plugins.values import parse_int, shorten
from titan_plugins.values import shown_value as shown_value

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


_UPPER_SNAKE = frozenset(string.ascii_uppercase + string.digits + "_")


def _is_upper_snake(name: str) -> bool:
    # ``[A-Z][A-Z0-9_]*`` without compiling a pattern inside every ``import megatron``
    return bool(name) and name[0] in string.ascii_uppercase and _UPPER_SNAKE.issuperset(name)


class SettingError(ValueError):
    """A TITAN_* variable has a value the core or a plugin cannot accept (STRICT mode)."""


class Problem(str):
    """A problem message that also says what applies instead of the bad value (``fallback``),
    for problems where that is not simply "the default" (e.g. an allowlist with an unknown name,
    whose known names still apply)."""

    fallback: str

    def __new__(cls, message: str, fallback: str = "") -> Problem:  # "": pickle's call
        made = super().__new__(cls, message)
        made.fallback = fallback
        return made


class ByteSize(int):
    """Marker type for byte sizes such as ``4096``, ``512K``, ``4G`` (see :func:`parse_bytes`)."""


BYTES = ByteSize
_TYPES = (bool, int, float, str, list, ByteSize)
_TYPE_WORDS = {
    bool: "1 or 0",
    int: "an integer",
    float: "a finite number",
    str: "text",
    list: "a comma-separated list",
    ByteSize: "a byte size such as 4096, 512K, 64M or 4G",
}


def _raw(var: str) -> str | None:
    value = os.environ.get(var)
    return None if value is None else value.strip()


_STRICT_OVERRIDE: list[bool] = []  # innermost last; see strictness()


def strict() -> bool:
    """Whether TITAN_PLUGINS_STRICT asks for errors instead of warnings.

    A value that is not a switch value counts as on: the user asked for something, and failing
    loudly (the activation check names the variable) is safer than silently running lenient.
    """
    if _STRICT_OVERRIDE:
        return _STRICT_OVERRIDE[-1]
    value = (_raw("TITAN_PLUGINS_STRICT") or "").lower()
    return value not in ("",) + _FALSE


@contextlib.contextmanager
def strictness(value: bool | None) -> Iterator[None]:
    """Override STRICT for the block (None leaves the environment's choice); the CLI uses it to
    collect every problem instead of stopping at the first."""
    if value is None:
        yield
        return
    _STRICT_OVERRIDE.append(value)
    try:
        yield
    finally:
        _STRICT_OVERRIDE.pop()


_WARNED: set[str] = set()  # each bad value is reported once per process, not at every read
STRICT_SUFFIX = " (TITAN_PLUGINS_STRICT=1: fix the value or unset it)"


def strict_value_problem() -> str | None:
    """STRICT's own unreadable value, named as what it is (it counts as on, see :func:`strict`),
    or None when it reads as a switch value or is unset."""
    raw = _raw("TITAN_PLUGINS_STRICT") or ""
    if not raw or raw.lower() in _TRUE + _FALSE:
        return None
    return (
        f"TITAN_PLUGINS_STRICT={shown_value(raw)} is not a boolean "
        f"(accepted: {'/'.join(_TRUE)} or {'/'.join(_FALSE)})"
    )


def strict_reason() -> str:
    """What made this process strict, as the messages name it: ``TITAN_PLUGINS_STRICT=1``, or
    STRICT's own unreadable value (never reported as if STRICT=1 had been set)."""
    if _STRICT_OVERRIDE or strict_value_problem() is None:
        return "TITAN_PLUGINS_STRICT=1"
    return "an unreadable TITAN_PLUGINS_STRICT counts as on"


def strict_suffix() -> str:
    """The tail of a STRICT error: why the process is strict, and the fix."""
    if strict_reason() == "TITAN_PLUGINS_STRICT=1":
        return STRICT_SUFFIX
    return f" ({strict_reason()}: fix the values or unset them)"


def complain(message: str, fallback: str = "") -> None:
    """Report bad input: a warning (once per message and process) saying what happens instead,
    or :class:`SettingError` under STRICT.

    :param fallback: what the code does instead, e.g. ``"default 1 used"`` (warnings only).
    """
    if strict():
        raise SettingError(message + strict_suffix())
    if message in _WARNED:
        return
    _WARNED.add(message)
    logger.warning("%s (%s)", message, fallback) if fallback else logger.warning(message)


def _format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


class Setting:
    """One environment knob: its declaration and its reader.

    :param name: the variable, ``TITAN_<PLUGIN>_<KNOB>``.
    :param type: ``bool``, ``int``, ``float``, ``str``, ``list`` (comma list read as a tuple of
        strings) or :data:`BYTES`.
    :param default: the value when unset or empty (typed; may be None for "automatic").
    :param doc: one sentence: what it changes.
    :param choices: accepted values of a ``str`` (or of each item of a ``list``), compared
        case-insensitively and returned as written here.
    :param minimum: lower bound of an ``int`` / ``float`` / bytes value (inclusive).
    :param maximum: upper bound (inclusive).
    :param validate: extra check on the parsed value: returns a message, or None when fine.
    :param default_text: how to show the default when it is not a value (e.g. ``"auto"``).
    """

    __slots__ = (
        "name",
        "type",
        "default",
        "doc",
        "choices",
        "minimum",
        "maximum",
        "validate",
        "default_text",
    )

    def __init__(
        self,
        name: str = "",
        type: Any = str,
        default: Any = None,
        doc: Any = "",
        choices: Iterable[str] | None = None,
        minimum: float | None = None,
        maximum: float | None = None,
        validate: Callable[[Any], str | None] | None = None,
        default_text: str = "",
    ) -> None:
        if type not in _TYPES:
            raise TypeError(
                f"Setting {name}: type must be one of bool, int, float, str, list, BYTES"
            )
        if not _is_upper_snake(name):
            raise ValueError(
                f"Setting {name!r}: the name must be UPPER_SNAKE (TITAN_<PLUGIN>_<KNOB>)"
            )
        self.name = name
        self.type = type
        self.default = default
        self.doc = doc
        self.choices = tuple(choices) if choices is not None else None
        self.minimum = minimum
        self.maximum = maximum
        self.validate = validate
        self.default_text = default_text

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.type.__name__}, {self.default!r})"

    # ------------------------------------------------------------------ parsing
    def accepted(self) -> str:
        """What a valid value looks like, for messages and ``titan-plugins env``."""
        if self.choices and self.type is str:
            return "one of " + ", ".join(self.choices)
        words = _TYPE_WORDS[self.type]
        if self.choices and self.type is list:
            words += " of " + ", ".join(self.choices)
        if self.minimum is not None and self.maximum is not None:
            words += f" from {_format_number(self.minimum)} to {_format_number(self.maximum)}"
        elif self.minimum is not None:
            words += f" >= {_format_number(self.minimum)}"
        elif self.maximum is not None:
            words += f" <= {_format_number(self.maximum)}"
        return words

    def parse(self, text: str) -> Any:
        """Convert the text of a set variable to the typed value.

        :raises ValueError: with a message naming what is accepted.
        """
        text = text.strip()
        value: Any
        if self.type is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError("not a switch value")
            value = text.lower() in _TRUE
        elif self.type is int:
            value = parse_int(text)
        elif self.type is float:
            try:
                value = float(text)
            except (ValueError, OverflowError):
                raise ValueError("not a number") from None
            if not math.isfinite(value):
                raise ValueError("not a finite number")
        elif self.type is ByteSize:
            value = parse_bytes(text)
        elif self.type is list:
            value = tuple(item.strip() for item in text.split(",") if item.strip())
            if self.choices:
                value = tuple(self._choose(item) for item in value)
        else:
            value = self._choose(text) if self.choices else text
        self._check_range(value)
        if self.validate is not None:
            message = self.validate(value)
            if message:
                raise ValueError(message)
        return value

    def _choose(self, text: str) -> str:
        for choice in self.choices or ():
            if text.lower() == choice.lower():
                return choice
        raise ValueError(f"{shown_value(text)} is not one of {', '.join(self.choices or ())}")

    def _check_range(self, value: Any) -> None:
        if self.type not in (int, float, ByteSize):
            return
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"below the minimum {_format_number(self.minimum)}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"above the maximum {_format_number(self.maximum)}")

    # ------------------------------------------------------------------ reading
    def is_set(self) -> bool:
        """Whether the variable is set to a non-empty value."""
        return bool(_raw(self.name))

    def problem(self) -> str | None:
        """The message for a bad current value, or None when unset, empty or valid."""
        return self._evaluate()[1]

    def read(self) -> Any:
        """The typed value; the default when unset, empty or malformed (see :func:`complain`)."""
        value, message = self._evaluate()
        if message is not None:
            complain(message, message.fallback)
        return value

    def _evaluate(self) -> tuple[Any, Problem | None]:
        """(value, None) for a good or absent value, (default, message) for a bad one. Any
        exception of the conversion or of a plugin's ``validate`` is this knob's problem: it
        must never escape into the activation, where it would turn every plugin off."""
        text = _raw(self.name)
        if not text:
            return self.default, None
        try:
            return self.parse(text), None
        except ValueError as err:
            reason = str(err)
        except Exception as err:
            reason = f"its check raised {type(err).__name__}: {err}"
        message = f"{self.name}={shown_value(text)}: {shorten(reason)}; accepted: {self.accepted()}"
        return self.default, Problem(message, f"default {self.shown_default()} used")

    def shown_default(self) -> str:
        """The default as a user would write it."""
        if self.default_text:
            return self.default_text
        if self.default is None:
            return "unset"
        if self.type is bool:
            return "1" if self.default else "0"
        if self.type is list:
            return ",".join(self.default) or "(empty)"
        if self.type is ByteSize:
            return format_bytes(self.default)
        return str(self.default) if self.default != "" else "(empty)"


def problems(settings: Iterable[Setting]) -> list[str]:
    """Messages for every bad current value among ``settings`` (activation and doctor); one
    knob that cannot even be checked is its own message, never an exception."""
    found = []
    for setting in settings:
        if not isinstance(setting, Setting):
            found.append(f"{setting!r} is declared as a knob but is not a titan_plugins Setting")
            continue
        try:
            message = setting.problem()
        except Exception as err:  # e.g. accepted() of an odd declaration
            message = f"{setting.name}: checking its value raised {type(err).__name__}: {err}"
        if message:
            found.append(message)
    return found
