"""Make untrusted text and numbers safe to print and to write as JSON.

File names, kernel names and header strings come from the traces: control characters (terminal
escape sequences) are escaped before they reach a terminal, and non-finite floats become
``null`` so the JSON report is always valid JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def safe_text(text: Any, limit: int = 300) -> str:
    """``text`` with control / bidi characters escaped (``\\x1b``), cut to ``limit`` chars."""
    s = str(text)
    if len(s) > limit:
        s = s[: limit - 3] + "..."
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), s)


def finite(obj: Any) -> Any:
    """A copy of ``obj`` with NaN / infinity replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def json_text(obj: Any, indent: int | None = 1) -> str:
    """Strict JSON text of ``obj`` (non-finite numbers as null; never NaN / Infinity)."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)
