"""One rank's per-step timelines on disk, readable one step at a time.

The map step writes each rank's timeline (compute runs, communication ops, bubbles per step)
to a file the cross-rank analyses read back: the critical path once per step and rank it
visits, the merged trace and the HTML once per rank for one step.  Keeping them on disk keeps
the parent's memory flat in ranks; storing each step as its own JSON blob behind an index means
a reader parses only the step it asks for (before, every read parsed every step).

Layout: one line of JSON, ``{"rank", "keys", "index": {step: [offset, length]}}``, then the
steps' JSON blobs back to back (offsets count from the byte after that line).  Both JSON
writers used here escape newlines inside strings, so the first newline ends the header.
"""

from __future__ import annotations

from typing import Any

from .fastpath import dumps, loads

SUFFIX = ".tl"


def write(path: str, rank: int, keys: dict[str, Any], steps: dict[str, Any]) -> None:
    """Write ``steps`` (step number as text -> timeline) of ``rank`` to ``path``."""
    blobs = [(k, dumps(v)) for k, v in steps.items()]
    index, offset = {}, 0
    for k, blob in blobs:
        index[k] = [offset, len(blob)]
        offset += len(blob)
    with open(path, "wb") as fh:
        fh.write(dumps({"rank": rank, "keys": keys, "index": index}) + b"\n")
        fh.writelines(blob for _, blob in blobs)


def read_steps(path: str, steps: list[str] | None = None) -> dict[str, Any]:
    """The header plus ``steps`` (every step when None) as ``{"rank", "keys", "steps"}``; a step
    the rank did not record is absent from ``steps``."""
    with open(path, "rb") as fh:
        head = loads(fh.readline())
        base = fh.tell()
        got = {}
        for k in head["index"] if steps is None else steps:
            where = head["index"].get(k)
            if where is None:
                continue
            fh.seek(base + where[0])
            got[k] = loads(fh.read(where[1]))
    return {"rank": head["rank"], "keys": head["keys"], "steps": got}


def read_step(path: str, step: str) -> dict[str, Any] | None:
    """One step's timeline, or None when the rank did not record it."""
    return read_steps(path, [step])["steps"].get(step)
