"""Events the map step cannot use, counted per file by reason and by kind.

An event is dropped, never guessed at, when a value it needs is impossible: a ts that is not a
number, not finite or beyond ``MAX_TS``; a dur that is negative, not finite or over
``MAX_DUR``; no integer ``pid`` and ``tid`` (Kineto writes both on every event; launch records
are read for their thread only); a number beyond the double range (orjson refuses it, the
standard-library codec is made to refuse it alike); a string over the per-string limit; text
that is not JSON.  Every drop is counted, and the summary lists the counts as a problem of the
file, so a figure built without those events never passes for a measured one.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from .kinds import COMM, COMPUTE, kernel_class

MAX_TS = 1e17  # us: year 5138; Kineto writes epoch microseconds (~1.7e15) or smaller offsets
MAX_DUR = 1e11  # us: 28 hours for one event

REASONS = {  # reason -> what the message says, in this order
    "dur_negative": "with a negative dur",
    "dur_range": f"with a dur that is not finite or over {MAX_DUR:.0e} us (28 h)",
    "dur": "with a dur that is not a number",
    "ts_range": f"with a ts that is not finite or beyond +-{MAX_TS:.0e} us",
    "ts": "without a numeric ts",
    "times": "with a ts or dur out of range",
    "number": "with a number beyond the double range (e.g. a 400-digit ts)",
    "ids": "without an integer pid and tid",
    "string": "with a string over the per-string limit (raise it with --max-string-mb)",
    "unparsable": "that are not valid JSON",
}
GPU_KINDS = ("compute kernel", "communication kernel", "memory op", "GPU event")
CAT = re.compile(rb'"cat"\s*:\s*"([^"]*)"')


class Drops:
    """Dropped events of one file, counted by (reason, kind)."""

    def __init__(self) -> None:
        self.pairs: Counter[tuple[str, str]] = Counter()

    def add(self, reason: str, kind: str) -> None:
        """Count one dropped event (``reason``: a key of REASONS)."""
        self.pairs[(reason, kind)] += 1

    def merge(self, other: Drops, kinds: tuple[str, ...]) -> None:
        """Add ``other``'s drops of the given kinds (a second pass over the same file)."""
        for (reason, kind), n in other.pairs.items():
            if kind in kinds:
                self.pairs[(reason, kind)] += n

    @property
    def reasons(self) -> Counter[str]:
        """Dropped events per reason."""
        out: Counter[str] = Counter()
        for (reason, _kind), n in self.pairs.items():
            out[reason] += n
        return out

    @property
    def kinds(self) -> Counter[str]:
        """Dropped events per kind (compute kernel, launch, ProfilerStep, CPU op, ...)."""
        out: Counter[str] = Counter()
        for (_reason, kind), n in self.pairs.items():
            out[kind] += n
        return out

    def total(self) -> int:
        """How many events were dropped."""
        return sum(self.pairs.values())

    def gpu(self) -> int:
        """Dropped GPU events (kernels, memcpy / memset)."""
        kinds = self.kinds
        return sum(kinds[k] for k in GPU_KINDS)

    def reasons_of(self, kind: str) -> str:
        """Why the events of one kind were dropped, e.g. "3 with a negative dur"."""
        counts = {r: n for (r, k), n in self.pairs.items() if k == kind}
        return ", ".join(f"{counts[r]} {REASONS[r]}" for r in REASONS if r in counts)

    def summary(self) -> dict[str, Any]:
        """The counts, for the summary and the JSON report."""
        return {"total": self.total(), "reasons": dict(self.reasons), "kinds": dict(self.kinds)}

    def message(self) -> str | None:
        """One problem line naming every reason and kind, or None when nothing was dropped."""
        n = self.total()
        if not n:
            return None
        reasons = self.reasons
        why = ", ".join(f"{c} {REASONS[r]}" for r in REASONS if (c := reasons[r]))
        what = ", ".join(f"{c} {_plural(k, c)}" for k, c in self.kinds.most_common())
        return f"{n} events dropped as impossible (not analysed): {why}; by kind: {what}"


def _plural(kind: str, n: int) -> str:
    return kind if n == 1 else "launches" if kind == "launch" else kind + "s"


def valid_id(value: Any) -> bool:
    """A pid or tid as Kineto writes it: an integer (not a bool)."""
    return type(value) is int


def ts_of(ts: Any) -> float | str:
    """A ts as a float, or the reason it is dropped."""
    if type(ts) is not float and type(ts) is not int:  # bools and strings are no times
        return "ts"
    try:
        ts = float(ts)
    except OverflowError:  # an int beyond the double range (the codecs refuse most)
        return "ts_range"
    return ts if -MAX_TS <= ts <= MAX_TS else "ts_range"  # NaN fails too


def check(ev: dict[str, Any], ids: bool = True) -> tuple[float, float] | str:
    """(start, end) of an event, or the reason it is dropped (a key of REASONS).

    ``ids``: pid and tid must be integers too."""
    ts = ts_of(ev.get("ts"))
    if type(ts) is str:
        return ts
    dur = ev.get("dur", 0.0)
    if type(dur) is not float and type(dur) is not int:
        return "dur"
    try:
        dur = float(dur)
    except OverflowError:
        return "dur_range"
    if dur < 0:
        return "dur_negative"
    if not dur <= MAX_DUR:
        return "dur_range"
    if ids and not (valid_id(ev.get("pid")) and valid_id(ev.get("tid"))):
        return "ids"
    return ts, ts + dur  # type: ignore[operator]


def gpu_kind(name: Any, cat: str) -> str:
    """The kind of a dropped GPU event, by its name as the op builder would class it."""
    if not isinstance(name, str):
        name = "" if name is None else str(name)
    k = kernel_class(name, cat)
    return (
        "compute kernel" if k == COMPUTE else "communication kernel" if k == COMM else "memory op"
    )


def piece_kind(piece: bytes) -> str:
    """The kind of an event whose text could not be parsed, from its "cat"."""
    m = CAT.search(piece)
    cat = m.group(1) if m else b""
    if cat in (b"kernel", b"gpu_memcpy", b"gpu_memset"):
        return "GPU event"
    if cat.endswith((b"_runtime", b"_driver")):
        return "launch"
    if cat == b"cpu_op" and b"ProfilerStep#" not in piece:
        return "CPU op"
    if cat in (b"user_annotation", b"cpu_op"):
        return "annotation"
    return "event"


def event_kind(ev: dict[str, Any]) -> str:
    """The kind of a parsed event the reader drops."""
    cat = ev.get("cat")
    if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        return gpu_kind(ev.get("name"), cat)
    if isinstance(cat, str) and cat.endswith(("_runtime", "_driver")):
        return "launch"
    name = ev.get("name")
    if isinstance(name, str) and name.startswith("ProfilerStep#"):
        return "ProfilerStep"
    return "CPU op" if cat == "cpu_op" else "annotation"
