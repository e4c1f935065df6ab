"""Stream one rank's Kineto (Chrome-trace JSON) file, compressed by an external ``gzip -1``.

Events arrive as pre-formatted JSON strings; compression runs in a child process so it uses a
second core while the simulator formats the next events.
"""

from __future__ import annotations

import json
import subprocess
from typing import IO, Any

FLUSH_EVERY = 4096


class Writer:
    """One trace file: the header before ``traceEvents``, the events, then the trailer."""

    def __init__(
        self, path: str, header: dict[str, Any], trailer: dict[str, Any], gz: bool = True
    ) -> None:
        self.path = path
        self.fh = open(path, "wb")  # closed in close()
        self.proc: subprocess.Popen[bytes] | None = None
        self.out: IO[bytes] = self.fh
        if gz:
            self.proc = subprocess.Popen(
                ["gzip", "-1", "-c"], stdin=subprocess.PIPE, stdout=self.fh
            )
            assert self.proc.stdin is not None
            self.out = self.proc.stdin
        head = json.dumps(header)[:-1]  # drop the closing brace: the events follow
        self.out.write((head + ', "traceEvents": [\n').encode())
        self.trailer = trailer
        self.buf: list[str] = []
        self.n = 0
        self.first = True

    def add(self, event: str) -> None:
        """Append one event (a JSON object as text)."""
        self.buf.append(event)
        if len(self.buf) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Write the buffered events."""
        if self.buf:
            data = ",\n".join(self.buf)
            if not self.first:
                data = ",\n" + data
            self.first = False
            self.out.write(data.encode())
            self.n += len(self.buf)
            self.buf = []

    def close(self) -> int:
        """Finish the file; returns the number of events written."""
        self.flush()
        tail = json.dumps(self.trailer)[1:]
        self.out.write(("\n], " + tail + "\n").encode())
        if self.proc is not None:
            self.out.close()
            self.proc.wait()
        self.fh.close()
        return self.n
