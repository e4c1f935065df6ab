"""Uneven ``all_to_all_single`` with async work handles, plus an optional simulated link.

Every transfer of the backend goes through :func:`all_to_all_rows`: rows of a ``[N, ...]`` tensor,
``out_counts[r]`` rows received from rank r, ``in_counts[r]`` rows sent to it. FP8 tensors travel
as bytes (gloo has no float8 reduction types; a byte copy is exact).

The simulated link (:func:`set_link_model`, benchmarks only) delays the *completion* of each
transfer as a serial link of a given bandwidth would: a transfer issued at ``t`` completes at
``max(t, link free) + bytes / bandwidth + latency``. The host is not blocked at issue time, so
work done between issuing and waiting hides the delay - which is what the overlap schedule
exploits and what the benchmark measures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


@dataclass
class LinkModel:
    """A serial link: ``seconds_per_byte`` (1 / bandwidth) and a fixed ``latency_s`` per transfer."""

    seconds_per_byte: float = 0.0
    latency_s: float = 0.0
    free_at: float = 0.0  # when the link finishes the transfers issued so far (perf_counter)


_link: LinkModel | None = None
# all-to-alls started by this process, the bytes it sent to other ranks (what crosses a link) and
# the host time spent waiting for transfers (benchmarks)
traffic = {"transfers": 0, "bytes": 0, "remote_bytes": 0, "wait_s": 0.0}


def set_link_model(seconds_per_byte: float = 0.0, latency_s: float = 0.0) -> None:
    """Simulate a slower link for every later transfer of this process (benchmarks only)."""
    global _link
    _link = LinkModel(seconds_per_byte, latency_s, 0.0)


def clear_link_model() -> None:
    """Back to the real transport only."""
    global _link
    _link = None


class _TimedWork:
    """A Work that adds the time its ``wait`` blocks to ``traffic["wait_s"]``; with a simulated
    link it also waits until the link delivered the data (``ready_at``)."""

    def __init__(self, work: Any, ready_at: float = 0.0) -> None:
        self._work, self._ready_at = work, ready_at

    def wait(self) -> bool:
        start = time.perf_counter()
        if self._ready_at > start:
            time.sleep(self._ready_at - start)
        done = self._work.wait()
        traffic["wait_s"] += time.perf_counter() - start
        return done


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t


def all_to_all_rows(
    inp: torch.Tensor,
    out_counts: Sequence[int],
    in_counts: Sequence[int],
    group: dist.ProcessGroup,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """Start an uneven all-to-all of rows; returns ``(output, work)`` (wait before reading).

    ``inp`` rows are grouped by destination rank in rank order (``in_counts`` per rank); the output
    has ``sum(out_counts)`` rows grouped by source rank. ``out`` may be given with more rows (the
    extra rows are left untouched), e.g. DeepEP's ``num_worst_tokens`` padding.
    """
    inp = inp.contiguous()
    received = int(sum(out_counts))
    if out is None:
        out = inp.new_empty((received, *inp.shape[1:]))
    work = dist.all_to_all_single(
        _wire(out[:received]),
        _wire(inp),
        output_split_sizes=list(out_counts),
        input_split_sizes=list(in_counts),
        group=group,
        async_op=True,
    )
    row_bytes = inp.element_size() * math.prod(inp.shape[1:])
    moved = row_bytes * max(sum(in_counts), sum(out_counts))
    traffic["transfers"] += 1
    traffic["bytes"] += moved
    traffic["remote_bytes"] += row_bytes * (sum(in_counts) - in_counts[dist.get_rank(group)])
    if _link is None:
        return out, _TimedWork(work)
    start = max(time.perf_counter(), _link.free_at)
    _link.free_at = start + moved * _link.seconds_per_byte + _link.latency_s
    return out, _TimedWork(work, _link.free_at)


def all_gather_rows(row: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Synchronous all-gather of one small 1-D tensor per rank -> ``[group size, len]``."""
    ranks = dist.get_world_size(group)
    out = row.new_empty(ranks * row.numel())  # gloo wants a flat output
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    start = time.perf_counter()
    gather(out, row.contiguous().view(-1), group=group)
    traffic["wait_s"] += time.perf_counter() - start
    return out.view(ranks, row.numel())
