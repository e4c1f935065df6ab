"""The core's one-sided Mooncake write, between two real TCP engines in one process: ranges land
bit for bit, ranges adjacent on both sides go as one transfer, and a refused write raises the
caller's error class naming the peer; without Mooncake installed, the caller's error names the
install."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from titan_plugins.transport import mooncake
from titan_plugins.transport.mooncake import MooncakeEngine, coalesced

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


class Settings(NamedTuple):
    protocol: str = "tcp"
    host: str = "127.0.0.1"
    device: str = ""
    timeout_s: float = 5.0
    metadata: str = mooncake.P2PHANDSHAKE


class Refused(RuntimeError):
    """The caller's own error class."""


def test_ranges_contiguous_on_both_sides_merge_and_empty_ones_drop() -> None:
    ranges = [(0, 100, 10), (10, 110, 5), (15, 200, 5), (20, 205, 0), (20, 205, 3), (40, 208, 1)]
    assert coalesced(ranges) == [(0, 100, 15), (15, 200, 8), (40, 208, 1)]
    assert coalesced([]) == []


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[MooncakeEngine, MooncakeEngine]]:
    before = dict(os.environ)  # an engine sets Mooncake's MC_* defaults: keep them to this file
    try:
        yield (
            MooncakeEngine(Settings(), who="writer", error=Refused),
            MooncakeEngine(Settings(), who="target", error=Refused),
        )
    finally:
        os.environ.clear()
        os.environ.update(before)


def test_a_write_lands_every_range_in_one_transfer_per_run(pair, monkeypatch) -> None:
    writer, target = pair
    source = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    landing = torch.zeros(4 << 20, dtype=torch.uint8)
    writer.register(source)
    target.register(landing)
    submitted: list[int] = []
    submit = writer._te.batch_transfer_async_write

    class Counting:  # the pybind engine's attributes are read-only: wrap it
        def __init__(self, te) -> None:
            self._te = te

        def __getattr__(self, name: str):
            return getattr(self._te, name)

        def batch_transfer_async_write(self, peer, local, remote, lengths):
            submitted.append(sum(lengths))
            return submit(peer, local, remote, lengths)

    monkeypatch.setattr(writer, "_te", Counting(writer._te))
    at, to = source.data_ptr(), landing.data_ptr()
    try:
        # two runs: [0, 2 MiB) as two adjacent ranges, then 1 MiB written 512 KiB further on
        writer.write(
            target.session_id,
            [at, at + (1 << 20), at + (2 << 20)],
            [to, to + (1 << 20), to + (2 << 20) + (512 << 10)],
            [1 << 20, 1 << 20, 1 << 20],
        )
        assert submitted == [2 << 20, 1 << 20]
        assert torch.equal(landing[: 2 << 20], source[: 2 << 20])
        assert torch.equal(landing[(5 << 19) : (7 << 19)], source[2 << 20 :])
        assert not landing[2 << 20 : 5 << 19].any()  # the gap was not written
    finally:
        writer.unregister(source)
        target.unregister(landing)


def test_a_write_into_memory_the_peer_no_longer_registers_raises_by_name(pair) -> None:
    writer, target = pair
    source = writer.register(torch.ones(1 << 16, dtype=torch.uint8))
    landing = target.register(torch.zeros(1 << 16, dtype=torch.uint8))
    target.unregister(landing)
    try:
        with pytest.raises(
            Refused, match=f"writer: Mooncake write of 65536 B to {target.session_id}"
        ):
            writer.write(target.session_id, [source.data_ptr()], [landing.data_ptr()], [1 << 16])
        assert not landing.any()
        with pytest.raises(Refused, match="could not start"):  # nobody listens there
            writer.write("127.0.0.1:1", [source.data_ptr()], [landing.data_ptr()], [1 << 16])
    finally:
        writer.unregister(source)


def test_without_mooncake_an_engine_raises_the_callers_error_naming_the_install(
    monkeypatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # its import now raises
    with pytest.raises(Refused, match="writer: Mooncake Transfer Engine is not installed.*pip"):
        MooncakeEngine(Settings(), who="writer", error=Refused, hint="; or switch it off")
