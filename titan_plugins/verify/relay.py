"""What ``titan-plugins verify``'s children print, less the native libraries' start-up chatter.

The differential check's workers (forked by the preloaded pools' fork server, or spawned) write
to the file descriptors 1 and 2 they inherit from this process, and so do the native libraries
inside them: glog (Mooncake), Kineto and torch's C++ logging write to the descriptors directly,
below any Python stream. (The upstream tests' ranks write to log files; the tail of one printed
for a crashed job is filtered where it is read, :func:`~titan_plugins.verify.upstream._problem`.)
So while the checks run, descriptors 1 and 2 are pipes: one thread per pipe copies each line
to the real stdout or stderr as it arrives, unless :mod:`titan_plugins.native_noise` names it
chatter; ``verbose`` copies every line. Every other line (a real warning, a traceback) passes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import BinaryIO

from titan_plugins import native_noise
from titan_plugins.verify import interrupt

DRAIN_S = 10.0
"""How long the end of the relay waits for the pipes' last lines (every writer is gone by then:
verify stops its children first)."""


class Relay:
    """Descriptors 1 and 2 through the filter while the ``with`` block runs."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.dropped = 0
        self._saved: list[tuple[int, int]] = []  # (descriptor, its duplicate: the terminal)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Relay:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            self._start()
        except BaseException:  # e.g. a Ctrl-C held back until the block below ended
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        # the copying threads start with SIGINT blocked: a Ctrl-C goes to the main thread
        with interrupt.shielded():
            for fd in (1, 2):
                read, write = os.pipe()
                saved = os.dup(fd)
                os.dup2(write, fd)
                os.close(write)
                self._saved.append((fd, saved))
                thread = threading.Thread(
                    target=self._copy,
                    args=(os.fdopen(read, "rb"), os.fdopen(saved, "wb", closefd=False)),
                    name=f"titan-verify-relay-{fd}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def _copy(self, source: BinaryIO, sink: BinaryIO) -> None:
        """One pipe to its terminal, line by line as each arrives, less the chatter."""
        with source:
            for raw in iter(source.readline, b""):
                if not self.verbose and native_noise.is_noise(raw):
                    with self._lock:
                        self.dropped += 1
                    continue
                with contextlib.suppress(OSError):  # a closed terminal: keep draining
                    sink.write(raw)
                    sink.flush()

    def __exit__(self, *exc_info: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, saved in self._saved:
            os.dup2(saved, fd)  # this process's end of the pipe closes: EOF once no child holds it
        for thread in self._threads:
            thread.join(DRAIN_S)
        for (_, saved), thread in zip(self._saved, self._threads):
            if not thread.is_alive():  # a thread still copying keeps writing to it
                os.close(saved)
        self._saved, self._threads = [], []
