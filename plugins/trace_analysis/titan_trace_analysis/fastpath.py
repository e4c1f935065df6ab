"""JSON parsing and gzip inflation: orjson and ISA-L (both normal dependencies where wheels exist)
or the standard library (``--pure-python``, or where they are not installed), and the native
scanner of the reader's loop (built at install where a C compiler exists).  All give the same
results; see the README for what each costs per event.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - the default install has it
    orjson = None  # type: ignore[assignment]
try:
    from titan_trace_analysis import _native
except ImportError:  # built without a C compiler: the reader's Python loop serves
    _native = None  # type: ignore[assignment]
try:
    from isal import isal_zlib
except ImportError:  # pragma: no cover - the default install has it where wheels exist
    isal_zlib = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Codec:
    """The parser and inflater one reader uses."""

    name: str
    loads: Callable[[bytes], Any]
    json_errors: tuple[type[Exception], ...]
    decompressobj: Callable[[int], Any]
    inflate_errors: tuple[type[Exception], ...]


def _std_loads(data: bytes) -> Any:
    # NaN / Infinity literals are not JSON; the standard parser would accept them silently.
    # Numbers are read as orjson reads them, so both codecs drop the same events: integers
    # outside [-2**63, 2**64) become floats, and a number beyond the double range is an error
    return json.loads(
        data, parse_constant=_reject_constant, parse_int=_orjson_int, parse_float=_orjson_float
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


OVERFLOW = "number is infinity when parsed as double"  # orjson's words for it


def _orjson_int(text: str) -> int | float:
    n = int(text)
    if -(1 << 63) <= n < 1 << 64:
        return n
    return _orjson_float(text)


def _orjson_float(text: str) -> float:
    x = float(text)
    if x in (math.inf, -math.inf):
        raise ValueError(OVERFLOW)
    return x


PURE = Codec("stdlib", _std_loads, (ValueError, RecursionError), zlib.decompressobj, (zlib.error,))


def codec(pure: bool = False) -> Codec:
    """The fast codec when installed and not ``pure``, else the standard library's."""
    if pure or orjson is None:
        return PURE
    inflate = isal_zlib.decompressobj if isal_zlib is not None else zlib.decompressobj
    errors: tuple[type[Exception], ...] = (zlib.error,)
    if isal_zlib is not None:
        errors += (isal_zlib.error,)
    name = "orjson+isal" if isal_zlib is not None else "orjson"
    return Codec(name, orjson.loads, (orjson.JSONDecodeError, ValueError), inflate, errors)


NATIVE_API = 2  # the _native.scan signature the reader calls (the extension's API constant)


def native_stale() -> bool:
    """Whether the extension is built from older source (another scan signature): unused."""
    return _native is not None and getattr(_native, "API", 1) != NATIVE_API


def native_scan(pure: bool = False) -> Callable | None:
    """The native scanner's ``scan`` when built (from this source) and not ``pure``."""
    return None if pure or _native is None or native_stale() else _native.scan


def native_take(pure: bool = False) -> Callable | None:
    """The native op builder loop (``OpBuilder.batch`` in C) when built and not ``pure``."""
    return None if pure or _native is None else _native.take


def reader_name(pure: bool = False) -> str:
    """What reads traces here, e.g. ``native+orjson+isal`` (``titan-trace --version``)."""
    name = codec(pure).name
    if native_stale():  # said, not silent: the reader then costs ~2.5x the CPU
        name += " (native extension out of date: reinstall titan-trace-analysis)"
    return name if native_scan(pure) is None else f"native+{name}"


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes (orjson when installed)."""
    if orjson is not None:
        return orjson.dumps(obj)
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """Parse JSON bytes we wrote ourselves (orjson when installed)."""
    if orjson is not None:
        return orjson.loads(data)
    return json.loads(data)
