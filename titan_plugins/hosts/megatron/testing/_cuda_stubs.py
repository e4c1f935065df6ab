"""CPU stand-ins for the ``torch.cuda`` calls megatron-core makes unconditionally.

megatron-core 0.16.1 creates streams and events in constructors (e.g. the all-to-all token
dispatcher, token_dispatcher.py), seeds the CUDA RNG in ``model_parallel_cuda_manual_seed``
(tensor_parallel/random.py), and passes ``torch.cuda.current_device()`` as a device in ~175 places.
On a CPU-only torch these raise; here they become no-ops or map to the CPU generator.
Test-time only (see ``cpu_harness``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class DummyEvent:
    """A CUDA event stand-in: recording and waiting are no-ops; it is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """No-op: CPU work is synchronous."""

    def wait(self, stream: Any = None) -> None:
        """No-op: CPU work is synchronous."""

    def synchronize(self) -> None:
        """No-op: CPU work is synchronous."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, other: Any) -> float:
        """No timing on CPU."""
        return 0.0


class DummyStream:
    """A CUDA stream stand-in: every stream is the same (synchronous) CPU stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        """No-op: there is only one CPU stream."""

    def wait_event(self, event: Any) -> None:
        """No-op: events are always complete."""

    def record_event(self, event: Any = None) -> Any:
        """Return ``event`` (or a new dummy event); nothing to record."""
        return event if event is not None else DummyEvent()

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always idle."""
        return True

    def __eq__(self, other: object) -> bool:
        # megatron compares streams (e.g. "is this the current stream?"): all are the same one
        return isinstance(other, DummyStream)

    def __hash__(self) -> int:
        return 0


_DEFAULT_STREAM = DummyStream()


class _Nvtx:
    """``torch.cuda.nvtx`` stand-in (pipeline_parallel/utils.py and nvtx decorators call it)."""

    range_push = staticmethod(lambda *args, **kwargs: None)
    range_pop = staticmethod(lambda *args, **kwargs: None)
    range = staticmethod(lambda *args, **kwargs: contextlib.nullcontext())
    mark = staticmethod(lambda *args, **kwargs: None)


def _cpu_manual_seed(seed: int) -> None:
    # Must not call torch.manual_seed: that calls torch.cuda.manual_seed_all -> recursion.
    torch.default_generator.manual_seed(int(seed))


def patch_torch_cuda() -> None:
    """Replace the ``torch.cuda`` entry points megatron calls with CPU stand-ins.

    ``torch.cuda.is_available()`` is deliberately left alone: faking it breaks ``torch._dynamo``
    (``has_triton()`` then queries device properties).
    """
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")  # used as device=... all over megatron
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.Stream = DummyStream
    cuda.Event = DummyEvent
    cuda.current_stream = lambda *args, **kwargs: _DEFAULT_STREAM
    cuda.default_stream = lambda *args, **kwargs: _DEFAULT_STREAM
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.set_device = lambda *args, **kwargs: None
    cuda.empty_cache = lambda: None
    cuda.nvtx = _Nvtx
    # The "CUDA" RNG becomes the CPU default generator, so megatron's RNG tracker forks it.
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # record_stream(<dummy stream>) raises on CPU (pipeline_parallel/utils.py, moe_utils.py).
    torch.Tensor.record_stream = lambda self, *args, **kwargs: None
