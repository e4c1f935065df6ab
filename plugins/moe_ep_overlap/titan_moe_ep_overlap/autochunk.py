"""Pipeline a MoE layer only where it pays: time both paths, keep the faster, on every EP rank.

Why: the chunk pipeline hides all-to-all time behind expert compute, but it costs something per
chunk (n dispatches and combines instead of one, n passes through megatron's expert path). Where
there is nothing to hide it is a loss: on gloo over loopback the "transfer" is a memcpy done by
gloo's worker thread on the same few cores that compute (measured on 2 shared cores: 1.07-1.15x
under load). Where the link is slow it wins (0.6-0.75x). Which case holds depends on the link,
the load and the layer, so the plugin measures it.

How: per MoE layer, a trial window alternates the pipeline and the serial path (megatron's
unchunked flex forward), timing each forward (host clock on CPU; device events on accelerators,
read at the decision, long after they completed). Each rank takes the median of its
pipelined/serial ratios over the window's back-to-back pairs (a pair shares the load and link
state, so the ratio is much less noisy than the times) and the share of pairs the pipeline won;
at the end of the window the ranks of the layer's dispatcher group average both in one tiny
all_reduce, so all ranks apply the same rule to the same numbers and keep issuing identical
collectives. The pipeline is kept only when it is at least ``MARGIN`` faster and won at least
``WIN_SHARE`` of the pairs: where it costs a few percent (nothing to hide) it loses most pairs,
where it hides a slow link it wins every one. The decision holds for a steady period, long enough that the next
window's calls of the slower path cost at most ``TRIAL_BUDGET`` of it (from the measured gap), and
doubling while the decision stays the same, so a change of conditions (congestion, load) is
picked up again at a bounded cost.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from typing import Any

from titan_moe_ep_overlap import stats

WARMUP = 1  # unmeasured calls per path before the first trial (allocations, first-call paths)
TRIALS = 6  # measured (pipelined, serial) call pairs in a trial window
MARGIN = 0.02  # the pipeline's median pair ratio must be this much below 1 to be kept ...
WIN_SHARE = 0.8  # ... and it must have been faster in this share of the pairs (5 of 6)
FIRST_PERIOD, MAX_PERIOD = 32, 1024  # calls between trial windows (doubling while unchanged)
TRIAL_BUDGET = 0.01  # a steady period is long enough that re-measuring costs <= 1% of its time


class _HostTimer:
    """Host wall clock: on CPU the forward returns only after its transfers completed."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float) -> float:
        return time.perf_counter() - started


class _DeviceTimer:
    """Device events on the current stream; read when the decision is made."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def start(self) -> Any:
        event = self.module.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: Any) -> Any:
        end = self.module.Event(enable_timing=True)
        end.record()
        return (started, end)


def _seconds(sample: Any) -> float:
    if isinstance(sample, float):
        return sample
    start, end = sample
    end.synchronize()  # recorded calls ago: normally complete already
    return start.elapsed_time(end) / 1e3


def _timer() -> Any:
    from titan_plugins import platform

    module = platform.device_module()
    return _HostTimer() if module is None else _DeviceTimer(module)


class ChunkChooser:
    """Chooses 1 or ``chunks`` for each forward call of one MoE layer (see module docstring).

    :param chunks: the configured pipeline depth (> 1).
    :param agree: ``agree(values) -> their sums over the ranks``; every rank of the layer's
        dispatcher group calls it at the same call index (with its median ratio and 1).
    :param timer: ``start()`` / ``stop(started)`` pair (host or device clock).
    """

    def __init__(self, chunks: int, agree: Any, timer: Any) -> None:
        self.chunks, self.agree, self.timer = chunks, agree, timer
        self.pipelined = True  # until measured: the configured behaviour
        self.decisions = 0
        self.period = FIRST_PERIOD
        self._plan = self._trial_plan(WARMUP)
        self._samples: dict[int, list[Any]] = {1: [], chunks: []}
        self._current: tuple[int, bool, Any] | None = None

    def _trial_plan(self, warmup: int) -> list[tuple[int, bool]]:
        """(chunk count, measured?) for each call of the next window, alternating the paths."""
        plan = [(n, False) for _ in range(warmup) for n in (self.chunks, 1)]
        return plan + [(n, True) for _ in range(TRIALS) for n in (self.chunks, 1)]

    def begin(self) -> int:
        """The chunk count for this call (1 = serial); starts its clock when it is measured."""
        if not self._plan:
            self._decide()
        count, measured = self._plan.pop(0)
        self._current = (count, measured, self.timer.start() if measured else None)
        return count

    def end(self) -> None:
        """The call finished: keep its time when it was measured."""
        if self._current is None:
            return
        count, measured, started = self._current
        self._current = None
        if measured:
            self._samples[count].append(self.timer.stop(started))

    def _decide(self) -> None:
        if not self._samples[1]:  # a steady period ended: measure again
            self._plan = self._trial_plan(0)
            return
        # the two calls of a pair ran back to back (same load, same link state): their ratio is
        # far less noisy than either time; each rank's median ratio, averaged over the ranks
        ratios = [
            _seconds(p) / max(_seconds(s), 1e-9)
            for p, s in zip(self._samples[self.chunks], self._samples[1])
        ]
        wins = sum(r < 1.0 for r in ratios) / len(ratios)
        total, won, ranks = self.agree([statistics.median(ratios), wins, 1.0])
        ratio = total / ranks
        # Both: a load spike can make one pair (or the median of a few) look like a win; a
        # pipeline that only costs on this host loses most pairs, one that hides a link wins all
        keep = ratio < 1.0 - MARGIN and won / ranks >= WIN_SHARE
        same = self.decisions > 0 and keep == self.pipelined
        period = min(self.period * 2, MAX_PERIOD) if same else FIRST_PERIOD
        # the next window runs TRIALS calls of the path not chosen, each ``extra`` slower
        extra = 1.0 / ratio - 1.0 if keep else max(ratio - 1.0, 0.0)
        self.period = min(MAX_PERIOD, max(period, math.ceil(TRIALS * extra / TRIAL_BUDGET)))
        self.pipelined = keep
        self.decisions += 1
        stats.add("auto_decisions")
        stats.add("auto_kept_pipeline" if keep else "auto_chose_serial")
        self._samples = {1: [], self.chunks: []}
        self._plan = [(self.chunks if keep else 1, False)] * self.period


_choosers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _all_reduce_sum(group: Any) -> Any:
    def agree(values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        from titan_plugins import platform

        tensor = torch.tensor(values, dtype=torch.float64, device=platform.current_device())
        dist.all_reduce(tensor, group=group)
        return tensor.tolist()

    return agree


def for_layer(layer: Any, chunks: int) -> ChunkChooser:
    """The chooser of ``layer`` for ``chunks`` (a new one when the configured count changed)."""
    chooser = _choosers.get(layer)
    if chooser is None or chooser.chunks != chunks:
        group = layer.token_dispatcher._comm_manager.group
        chooser = _choosers[layer] = ChunkChooser(chunks, _all_reduce_sum(group), _timer())
    return chooser


def choice(layer: Any) -> bool | None:
    """Whether ``layer`` currently pipelines (None: no automatic choice made for it yet)."""
    chooser = _choosers.get(layer)
    return None if chooser is None or not chooser.decisions else chooser.pipelined
