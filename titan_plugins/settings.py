"""Typed, lazily read environment switches with clear messages for bad values.

Every reader takes the variable name and a default, reads ``os.environ`` at call time (a
process that imported us during ``import torch`` is not always the one that decides), and on a
malformed value warns with the accepted values and returns the default; under
``TITAN_PLUGINS_STRICT=1`` it raises :class:`SettingError` instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from titan_plugins._log import logger

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class SettingError(ValueError):
    """A TITAN_* variable has a value the core or a plugin cannot accept (STRICT mode)."""


@dataclass(frozen=True)
class Setting:
    """Declaration of one environment knob, for ``titan-plugins env`` and the READMEs.

    :param var: the variable name, ``TITAN_<PLUGIN>_<KNOB>``.
    :param default: the default as the user would write it.
    :param doc: one sentence: what it changes.
    :param choices: the accepted values, when they are a closed set.
    """

    var: str
    default: str
    doc: str
    choices: tuple[str, ...] | None = None


def _raw(var: str) -> str | None:
    value = os.environ.get(var)
    return None if value is None else value.strip()


def strict() -> bool:
    """Whether TITAN_PLUGINS_STRICT=1: drift and bad input raise instead of warning."""
    return (_raw("TITAN_PLUGINS_STRICT") or "").lower() in _TRUE


def complain(message: str) -> None:
    """Report bad input: a warning, or :class:`SettingError` under STRICT."""
    if strict():
        raise SettingError(message)
    logger.warning(message)


def env_bool(var: str, default: bool) -> bool:
    """Read a 0/1 switch (also true/false, yes/no, on/off)."""
    value = _raw(var)
    if value is None or value == "":
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    complain(f"{var}={value!r} is not a switch value; use 1 or 0 (default {int(default)} used)")
    return default


def env_int(var: str, default: int, minimum: int | None = None) -> int:
    """Read an integer, optionally with a lower bound."""
    value = _raw(var)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        complain(f"{var}={value!r} is not an integer (default {default} used)")
        return default
    if minimum is not None and number < minimum:
        complain(f"{var}={number} is below the minimum {minimum} (default {default} used)")
        return default
    return number


def env_float(var: str, default: float, minimum: float | None = None) -> float:
    """Read a float, optionally with a lower bound."""
    value = _raw(var)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        complain(f"{var}={value!r} is not a number (default {default} used)")
        return default
    if minimum is not None and number < minimum:
        complain(f"{var}={number} is below the minimum {minimum} (default {default} used)")
        return default
    return number


def env_choice(var: str, choices: Sequence[str], default: str) -> str:
    """Read one value out of a closed set (compared case-insensitively)."""
    value = _raw(var)
    if value is None or value == "":
        return default
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    complain(f"{var}={value!r} is not one of {', '.join(choices)} (default {default!r} used)")
    return default


def env_list(var: str, default: Sequence[str] = ()) -> tuple[str, ...]:
    """Read a comma-separated list; items are stripped and empty items dropped."""
    value = _raw(var)
    if value is None:
        return tuple(default)
    return tuple(item.strip() for item in value.split(",") if item.strip())


def parse_bytes(text: str) -> int:
    """Parse ``4096``, ``512K``, ``512M``, ``4G``, ``1.5GiB`` or ``2GB`` (binary units) to bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a byte size such as 4096, 512M or 4G")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()])


def env_bytes(var: str, default: int | None) -> int | None:
    """Read a byte size (see :func:`parse_bytes`)."""
    value = _raw(var)
    if value is None or value == "":
        return default
    try:
        return parse_bytes(value)
    except ValueError as err:
        complain(f"{var}: {err} (default {default} used)")
        return default
