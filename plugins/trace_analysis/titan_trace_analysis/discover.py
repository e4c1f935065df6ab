"""Find the trace files of a directory; report every entry that looks like a trace but cannot
be read (dangling or looping symlinks, FIFOs and other special files, unreadable files)."""

from __future__ import annotations

import errno
import os
import stat

from .safe import safe_text

TRACE_SUFFIXES = (".json", ".json.gz", ".gz")


def find_traces(trace_dir: str) -> tuple[list[str], list[dict[str, str]]]:
    """(readable trace files sorted by name, problems as {"file", "problem"})."""
    paths: list[str] = []
    problems: list[dict[str, str]] = []
    try:
        entries = sorted(os.scandir(trace_dir), key=lambda e: e.name)
    except OSError as exc:
        return [], [{"file": trace_dir, "problem": f"cannot list the directory ({exc.strerror})"}]
    for entry in entries:
        name = entry.name
        if not name.endswith(TRACE_SUFFIXES) or name.endswith(".timeline.json"):
            continue
        problem = _problem(entry)
        if problem:
            problems.append({"file": entry.path, "problem": problem})
        else:
            paths.append(entry.path)
    return paths, problems


def _problem(entry: os.DirEntry) -> str | None:
    try:
        st = os.stat(entry.path)  # follows symlinks
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop: skipped"
        if entry.is_symlink() and exc.errno == errno.ENOENT:
            target = safe_text(os.readlink(entry.path), 200)
            return f"dangling symlink (to {target}): skipped"
        return f"cannot stat ({exc.strerror}): skipped"
    if stat.S_ISDIR(st.st_mode):
        return "a directory, not a trace: skipped"
    if not stat.S_ISREG(st.st_mode):
        what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        return f"{what}: skipped (reading it could block or never end)"
    if not os.access(entry.path, os.R_OK):
        return "not readable (permissions): skipped"
    return None
