"""What a framework's weight updater holds across its updates: rank 0's connection to the
engines and each rank's writer (their staging buffers stay registered between updates).

Kept as attributes of the framework's own updater object, so they live and die with it.
"""

from __future__ import annotations

from typing import Any

from titan_weight_sync.settings import WeightSyncSettings
from titan_weight_sync.trainer_side import LandingWriter, WeightSync

SYNC = "_titan_weight_sync"
WRITER = "_titan_weight_sync_writer"


def engines(updater: Any, urls: list[str], **options: str) -> WeightSync:
    """The updater's connection to the engines at ``urls`` (rebuilt when the framework
    reconnects to other engines or asks for other session ``options``: :class:`WeightSync`'s
    ``pause_mode`` / ``selector``)."""
    held = getattr(updater, SYNC, None)
    if held is not None and [api.url for api in held.apis] == urls:
        if all(getattr(held, key) == value for key, value in options.items()):
            return held
    if held is not None:
        held.close()
    sync = WeightSync(urls, **options)
    setattr(updater, SYNC, sync)
    return sync


def writer(updater: Any) -> LandingWriter:
    """This rank's writer (the rank holding the engines' connection shares its staging
    buffer)."""
    held = getattr(updater, SYNC, None)
    if held is not None:
        return held.writer
    found = getattr(updater, WRITER, None)
    if found is None:
        found = LandingWriter(WeightSyncSettings.read())
        setattr(updater, WRITER, found)
    return found


def release(updater: Any) -> None:
    """Give back what the updater holds (staging buffers unregistered, ledger released)."""
    for name in (SYNC, WRITER):
        found = getattr(updater, name, None)
        if found is not None:
            found.close()
            setattr(updater, name, None)
