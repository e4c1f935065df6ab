"""Device <-> host copies of the offloader: blocks go to pooled host buffers on the d2h side
stream when they end and come back on the h2d side stream ahead of backward. On CPU the copies
are synchronous memcpys and no stream or event is touched; on GPUs events order the streams and
a device copy is released only once its d2h copy has completed."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import Any

import torch

from titan_act_offload.accounting import OffloadStats
from titan_act_offload.host_pool import HostBufferPool
from titan_act_offload.records import EXTERNAL, HOST, KEPT, RELOADED, STAGED, Block, Record

logger = logging.getLogger("titan_plugins.act_offload")
_NULL = contextlib.nullcontext()


class HostCopies:
    """Moves the records of a block to the host pool and back, and accounts for every byte.

    :param platform: ``titan_plugins.platform`` (or a stand-in): device, streams, events.
    :param stats: the offloader's counters.
    :param pool: host buffers (its budget limits what goes out).
    """

    def __init__(self, platform: Any, stats: OffloadStats, pool: HostBufferPool) -> None:
        self.platform = platform
        self.stats = stats
        self.pool = pool
        self.device = platform.current_device()
        self.asynchronous = platform.device_type() != "cpu"
        self.d2h_stream = platform.new_stream()
        self.h2d_stream = platform.new_stream()
        self._in_flight: deque[Record] = deque()
        self._budget_warned = False

    def keep(self, record: Record, reason: str) -> None:
        """Leave ``record`` on the device (it was headed to host)."""
        record.state = KEPT
        self.stats.keep(record, reason)

    def offload(self, block: Block) -> None:
        """Copy the block's staged records to host buffers (d2h stream on GPUs)."""
        records = [r for r in block.records if r.state == STAGED]
        if not records:
            return
        platform = self.platform
        done = None
        if self.asynchronous:  # CPU copies are synchronous: no events to order them
            ready = platform.new_event()
            ready.record(platform.current_stream())
            ready.wait(self.d2h_stream)  # copy only what compute has finished writing
            done = platform.new_event()
        with self._on(self.d2h_stream):
            for record in records:
                device = record.device
                assert device is not None
                if device.untyped_storage().nbytes() == 0:
                    # megatron's CheckpointWithoutOutput released it; its recompute restores
                    # the storage before backward reads it.
                    record.state = EXTERNAL
                    self.stats.leave(record)
                    self.stats.skip("released_storage", record.nbytes)
                    continue
                if device._version != record.version:
                    self.keep(record, "modified_in_place")
                    continue
                buffer = self.pool.acquire(record.nbytes)
                if buffer is None:
                    self._over_budget(record)
                    continue
                record.host_buffer = buffer
                record.host_view().copy_(device, non_blocking=self.asynchronous)
                record.state = HOST
                self.stats.offloaded_bytes += record.nbytes
                if done is None:
                    record.device = None
                    self.stats.leave(record)
                else:
                    record.done_event = done
                    self._in_flight.append(record)
            if done is not None:
                done.record(self.d2h_stream)

    def reload(self, block: Block, prefetch: bool, force: bool = False) -> None:
        """Bring the block's records on host back to the device (h2d stream on GPUs)."""
        if block.reloaded and not force:
            return
        records = [r for r in block.records if r.state == HOST]
        if not records:
            return  # nothing on host (kept block, or not ended yet): nothing to count
        block.reloaded = True
        block.prefetched = block.prefetched or prefetch
        with self._on(self.h2d_stream):
            for record in records:
                if record.done_event is not None:
                    record.done_event.wait(self.h2d_stream)
                if record.device is None:
                    tensor = torch.empty_strided(
                        record.size, record.stride, dtype=record.dtype, device=self.device
                    )
                    tensor.copy_(record.host_view(), non_blocking=self.asynchronous)
                    record.device = tensor
                record.state = RELOADED
                self.stats.enter(record, kept=False)
                if prefetch:
                    self.stats.prefetched_bytes += record.nbytes
                else:
                    self.stats.late_reload_bytes += record.nbytes
            if self.asynchronous:
                block.reload_event = self.platform.new_event()
                block.reload_event.record(self.h2d_stream)

    def wait_reloaded(self, record: Record, tensor: torch.Tensor) -> None:
        """Make the current stream wait for the reload of ``record`` before autograd uses it."""
        event = record.block.reload_event
        if self.asynchronous and record.state == RELOADED and event is not None:
            current = self.platform.current_stream()
            event.wait(current)
            tensor.record_stream(current)

    def poll(self) -> None:
        """Release device copies whose device-to-host copy has completed (GPU)."""
        while self._in_flight and self._in_flight[0].done_event.query():
            record = self._in_flight.popleft()
            record.done_event = None
            if record.state == HOST:
                record.device = None
                self.stats.leave(record)
            if record.handles == 0:
                self.release_host(record)

    def synchronize(self) -> None:
        """Wait for every copy in flight (end of a step)."""
        for record in self._in_flight:
            record.done_event.synchronize()
        self.poll()

    def release_host(self, record: Record) -> None:
        """Give the record's host buffer back to the pool."""
        if record.host_buffer is not None:
            self.pool.release(record.host_buffer)
            record.host_buffer = None

    def _on(self, stream: Any) -> Any:
        return self.platform.stream_context(stream) if self.asynchronous else _NULL

    def _over_budget(self, record: Record) -> None:
        self.keep(record, "host_budget")
        self.stats.kept_over_budget_bytes += record.nbytes
        if self._budget_warned:
            return
        self._budget_warned = True
        if self.pool.shared_refusals:
            from titan_plugins import host_memory

            logger.warning(
                "act_offload: the plugins' shared host-memory limit is reached (%s; held now: "
                "%s); further activations stay on the device. Raise it, or lower another "
                "plugin's share (e.g. rewind's snapshots).",
                host_memory.limit_text(),
                host_memory.held_text(),
            )
            return
        from titan_plugins.settings import describe_bytes

        logger.warning(
            "act_offload: host buffer budget reached (TITAN_ACT_OFFLOAD_MAX_HOST_BYTES = %s, %s in "
            "use); further activations stay on the device. Raise the budget or offload fewer "
            "blocks (TITAN_ACT_OFFLOAD_MODULES).",
            describe_bytes(self.pool.budget) if self.pool.budget is not None else "none",
            describe_bytes(self.pool.in_use),
        )
