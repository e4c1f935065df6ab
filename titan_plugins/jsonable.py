"""Plain, strict-JSON values from whatever a plugin's report or effects hand back.

A plugin's ``titan_report`` / ``titan_effects`` may hold what is natural in Python (a dict keyed
by ``(chunk, microbatch)`` tuples, a NaN loss, a path, a dataclass): the core's report is one
JSON document (``titan-plugins report --json``, the demo's ``--report``), so it converts at its
boundary rather than asking every plugin to get every value right.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

_MAX_DEPTH = 32  # a report nested deeper than this is a bug (or a cycle); cut it, never recurse


def jsonable(value: Any, _depth: int = 0) -> Any:
    """``value`` as str / int / float / bool / None, lists and str-keyed dicts only.

    Tuple keys become ``"a,b"``; other keys their ``str``; non-finite floats their ``repr``
    (``"nan"``, ``"inf"``), so the result passes ``json.dumps(..., allow_nan=False)``; tuples and
    sets become lists (sets sorted when they can be); any other object its ``str``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value, _depth)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else repr(float(value))
    if _depth >= _MAX_DEPTH:
        return f"<cut at depth {_MAX_DEPTH}: {type(value).__name__}>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {_key(k): jsonable(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        items = [jsonable(v, _depth + 1) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return items
    if isinstance(value, (list, tuple)):
        return [jsonable(v, _depth + 1) for v in value]
    return str(value)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, tuple):
        return ",".join(_key(k) for k in key)
    if isinstance(key, float) and not math.isfinite(key):
        return repr(key)
    return str(key)
