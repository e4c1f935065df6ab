"""One rank's per-step timelines on disk, readable one step at a time.

The map step writes each rank's timeline (compute runs, communication ops, bubbles per step)
to a file the cross-rank analyses read back: the critical path once per step and rank it
visits, the merged trace and the HTML once per rank for one step.  Keeping them on disk keeps
the parent's memory flat in ranks; storing each step as its own JSON blob behind an index means
a reader parses only the step it asks for (before, every read parsed every step).

Layout: one line of JSON, ``{"format", "rank", "keys", "index": {step: [offset, length]}}``,
then the steps' JSON blobs back to back (offsets count from the byte after that line).  Both JSON
writers used here escape newlines inside strings, so the first newline ends the header.
"""

from __future__ import annotations

from typing import Any

from .fastpath import dumps, loads

SUFFIX = ".tl"
FORMAT = 1  # in the header: a file of another layout (another version's) is refused, not misread


def write(path: str, rank: int, keys: dict[str, Any], steps: dict[str, Any]) -> None:
    """Write ``steps`` (step number as text -> timeline) of ``rank`` to ``path``."""
    blobs = [(k, dumps(v)) for k, v in steps.items()]
    index, offset = {}, 0
    for k, blob in blobs:
        index[k] = [offset, len(blob)]
        offset += len(blob)
    with open(path, "wb") as fh:
        fh.write(dumps({"format": FORMAT, "rank": rank, "keys": keys, "index": index}) + b"\n")
        fh.writelines(blob for _, blob in blobs)


def read_steps(path: str, steps: list[str] | None = None) -> dict[str, Any]:
    """The header plus ``steps`` (every step when None) as ``{"rank", "keys", "steps"}``; a step
    the rank did not record is absent from ``steps``."""
    with open(path, "rb") as fh:
        head = _header(loads(fh.readline()), path)
        base = fh.tell()
        got = {}
        for k in head["index"] if steps is None else steps:
            where = head["index"].get(k)
            if where is None:
                continue
            fh.seek(base + where[0])
            blob = loads(fh.read(where[1]))
            if not isinstance(blob, dict):
                raise ValueError(f"{path}: step {k} is not a timeline")
            got[k] = blob
    return {"rank": head["rank"], "keys": head["keys"], "steps": got}


def _header(head: Any, path: str) -> dict[str, Any]:
    """``head`` checked field by field; ValueError (what readers of a damaged file catch) when
    it is not this layout's header."""
    ok = (
        isinstance(head, dict)
        and head.get("format") == FORMAT
        and "rank" in head
        and isinstance(head.get("keys"), dict)
        and isinstance(head.get("index"), dict)
        and all(
            isinstance(w, list) and len(w) == 2 and all(type(x) is int and x >= 0 for x in w)
            for w in head["index"].values()
        )
    )
    if not ok:
        raise ValueError(f"{path}: not a titan-trace timeline file (format {FORMAT})")
    return head


def read_step(path: str, step: str) -> dict[str, Any] | None:
    """One step's timeline, or None when the rank did not record it."""
    return read_steps(path, [step])["steps"].get(step)
