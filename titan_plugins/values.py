"""Text to numbers and back for the knobs' readers and messages: byte sizes, 64-bit integers,
sizes written for people, and values shortened for messages. Standard library only.

Every conversion here is exact and bounded, so a reader's failure is always a ``ValueError``
that :class:`titan_plugins.settings.Setting` turns into that knob's own message (a 401-digit
value once went through ``float`` to ``inf`` and ``int(inf)`` raised ``OverflowError``, which
disabled every plugin).
"""

from __future__ import annotations

import re

BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# Integers and byte sizes must fit a signed 64-bit integer: that is what torch sizes, C APIs and
# the plugins' arithmetic take; a larger value is a typo, not a budget.
INT64_MAX = (1 << 63) - 1
_TOO_LARGE = f"too large: at most {INT64_MAX} (a signed 64-bit integer)"
_SHOWN_CHARS = 60  # a value longer than this is shortened in messages


def shown_value(text: str) -> str:
    """``repr(text)`` for messages; a value longer than 60 characters is shortened, with its
    length (a 401-digit value would otherwise fill the terminal, once per message)."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:24] + '...' + text[-8:]!r} ({len(text)} characters)"


def shorten(message: str, limit: int = 300) -> str:
    """``message`` cut to ``limit`` characters, ending in ``...`` when cut."""
    # a validator's message may quote the whole value (e.g. every bad item of a long list)
    return message if len(message) <= limit else message[: limit - 3] + "..."


def parse_bytes(text: str) -> int:
    """Parse ``4096``, ``512K``, ``512M``, ``4G``, ``1.5GiB`` or ``2GB`` (binary units) to bytes.

    Exact (no float rounding) and bounded: a size over :data:`INT64_MAX` bytes is refused
    before any conversion, so a 401-digit value is a "too large" ValueError, never an overflow.

    :raises ValueError: not a byte size, not a whole number of bytes, or too large.
    """
    match = re.fullmatch(r"\s*([0-9]*)\.?([0-9]*)\s*([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if not match or not (match.group(1) or match.group(2)) or text.strip().endswith("."):
        raise ValueError("not a byte size such as 4096, 512M or 4G")
    whole, fraction = match.group(1).lstrip("0"), match.group(2).rstrip("0")
    unit = BYTE_UNITS[match.group(3).upper()]
    if len(whole) > len(str(INT64_MAX)):  # int() of a long digit string is slow or refused
        raise ValueError(_TOO_LARGE)
    if len(fraction) > 40:  # x * 2**40 is whole only when x has at most 40 decimals
        raise ValueError("not a whole number of bytes")
    # integer arithmetic (no float, no fractions import inside ``import megatron``)
    part, remainder = divmod(int(fraction or 0) * unit, 10 ** len(fraction))
    if remainder:
        raise ValueError("not a whole number of bytes")
    number = int(whole or 0) * unit + part
    if number > INT64_MAX:
        raise ValueError(_TOO_LARGE)
    return number


def parse_int(text: str) -> int:
    """``int(text)`` bounded to a signed 64-bit integer (ValueError: not an integer, too large)."""
    digits = text.lstrip("+-").replace("_", "").lstrip("0")
    if len(digits) > len(str(INT64_MAX)) and digits.isdigit():  # before int(): see parse_bytes
        raise ValueError(_TOO_LARGE)
    try:
        value = int(text)
    except ValueError:
        raise ValueError("not an integer") from None
    if abs(value) > INT64_MAX:
        raise ValueError(_TOO_LARGE)
    return value


def format_bytes(value: int) -> str:
    """``65536`` -> ``64K``: the shortest exact binary-unit spelling."""
    for unit in ("T", "G", "M", "K"):
        size = BYTE_UNITS[unit]
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def describe_bytes(value: int) -> str:
    """``10328280`` -> ``9.85 MiB (10,328,280 bytes)``: readable and exact, for messages."""
    exact = f"{value:,} bytes"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            amount = value / size
            digits = 0 if value % size == 0 or abs(amount) >= 100 else 1 if abs(amount) >= 10 else 2
            shown = f"{amount:.{digits}f}"
            if value % size and float(shown) >= 1024:  # 1023.98 KiB must not read "1024 KiB"
                shown = f"{amount:.2f}"
            return f"{shown} {unit} ({exact})"
    return exact
