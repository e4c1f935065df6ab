"""CPU harness: lets unmodified megatron-core (0.16-0.19) build and train on CPU-only torch + gloo.

TEST-TIME ONLY. Nothing here activates by itself: plugin activation never calls it; only an
explicit ``install()`` (the gloo worker pool does so in its workers) switches it on, and it cannot
be switched off again in that process. No megatron file is edited; everything is a monkeypatch:

- ``torch.cuda`` streams/events/nvtx/synchronize -> no-ops; ``current_device()`` -> cpu; the CUDA
  RNG -> the CPU default generator (``_cuda_stubs``)
- a TorchFunctionMode rewriting ``device="cuda"`` etc. to cpu (``_cuda_to_cpu``), entered for
  good in the thread that calls ``install()``. torch keeps modes per thread: megatron code run in
  another thread needs ``with CudaToCpuMode():`` there (megatron's own train path is single-thread)
- megatron fixes, applied right after each module executes (or at once if already imported):
  ``tensor_parallel.random`` CUDA RNG state helpers, ``moe_utils.te_general_gemm`` (0.16.1 bug
  without Transformer Engine), ``maybe_move_tensor_to_cpu`` (EP split sizes), and TE's
  ``cpu_offload`` flag holder for fine-grained activation offloading, and MLA's ``HAVE_TE`` on
  0.16.1 (true there without Transformer Engine); MLA's core attention is ``mla_attention``'s,
  by spec substitution

Deliberately NOT fixed here (plugins must handle and test them; see DESIGN §7): the PP=2 + VPP
batched-P2P op order, and the freed-send-buffer hazard of ``deallocate_output_tensor``. A test that
needs overlapped P2P without the P2P plugin opts in with ``keeping_sent_buffers()`` (one block, the
right choice in shared workers) or ``install(keep_sent_buffers=True)`` (rest of the process).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import threading
import types
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from titan_plugins.hosts.megatron.testing._cuda_stubs import patch_torch_cuda
from titan_plugins.hosts.megatron.testing._cuda_to_cpu import CudaToCpuMode
from titan_plugins.testing._post_import import when_imported

__all__ = [
    "CudaToCpuMode",
    "install",
    "installed",
    "keeping_sent_buffers",
    "maybe_move_tensor_to_cpu",
]

_LOCK = threading.Lock()
_MODE: CudaToCpuMode | None = None
_KEEP_SENT_BUFFERS = False  # read by the deallocate_output_tensor wrapper at each call
_SCHEDULES_WRAPPED = False  # the wrapper is installed on the first opt-in only
# Storage of pseudo-freed pipeline outputs kept alive while a gloo isend may still read it; a few
# sends are in flight at most, 64 is ample for test pipelines.
_SENT_BUFFERS: collections.deque[torch.Tensor] = collections.deque(maxlen=64)

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_RANDOM = "megatron.core.tensor_parallel.random"
_TE_EXTENSIONS = "megatron.core.extensions.transformer_engine"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_MLA = "megatron.core.transformer.multi_latent_attention"


def installed() -> bool:
    """Whether ``install()`` has run in this process."""
    return _MODE is not None


def install(keep_sent_buffers: bool = False) -> None:
    """Install the CPU shims in this process (idempotent; cannot be undone).

    Call it before building megatron models; megatron may be imported before or after.
    ``keep_sent_buffers=True`` also turns on, for the rest of the process, keeping the old storage
    of pseudo-freed pipeline outputs alive (see ``keeping_sent_buffers``).
    """
    global _MODE
    with _LOCK:
        if _MODE is None:
            patch_torch_cuda()
            # The CUDA RNG is the CPU generator here, so megatron's tracker warns on every fork
            # that "CPU RNG state changed within GPU RNG context" (random.py); expected, silence it.
            logging.getLogger(_RANDOM).setLevel(logging.ERROR)
            _MODE = CudaToCpuMode()
            # Entered and never exited: the mode must cover every torch call for the rest of the
            # process (the stack is per thread; CPU autograd runs in the calling thread).
            _MODE.__enter__()
            when_imported(_RANDOM, _fix_random)
            when_imported(_MOE_UTILS, _fix_moe_utils)
            when_imported(_TOKEN_DISPATCHER, _fix_token_dispatcher)
            when_imported(_TE_EXTENSIONS, _fix_te_extensions)
            when_imported(_MLA, _fix_mla_have_te)
        if keep_sent_buffers:
            _set_keep_sent_buffers(True)


@contextlib.contextmanager
def keeping_sent_buffers() -> Iterator[None]:
    """Inside this block, ``schedules.deallocate_output_tensor`` keeps freed storage alive.

    megatron pseudo-frees a pipeline output right after *posting* its async send when
    ``overlap_p2p_comm`` and ``deallocate_pipeline_outputs`` are on; NCCL's caching allocator
    protects the buffer, a gloo isend reads freed memory (silently wrong losses or NaN). Outside
    the block the wrapper calls megatron's original function, so other tasks in a shared worker
    (e.g. a P2P plugin's test of that very hazard) see upstream behaviour. Installs the harness.
    """
    global _KEEP_SENT_BUFFERS
    install()
    previous = _KEEP_SENT_BUFFERS
    _set_keep_sent_buffers(True)
    try:
        yield
    finally:
        _KEEP_SENT_BUFFERS = previous
        if not previous:
            _SENT_BUFFERS.clear()


def _set_keep_sent_buffers(keep: bool) -> None:
    global _KEEP_SENT_BUFFERS, _SCHEDULES_WRAPPED
    _KEEP_SENT_BUFFERS = keep
    if keep and not _SCHEDULES_WRAPPED:
        _SCHEDULES_WRAPPED = True
        when_imported(_SCHEDULES, _wrap_schedules_deallocate)


def _fix_random(module: ModuleType) -> None:
    # random.py reads/writes torch.cuda.default_generators via _lazy_call, which never runs on CPU.
    module._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


def maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """CPU-correct version of ``moe_utils.maybe_move_tensor_to_cpu``.

    Upstream converts only ``if tensor.is_cuda``, so on CPU the EP all-to-all split sizes stay
    tensors and ``all_to_all_single(output_split_sizes=<Tensor>)`` raises TypeError (EP > 1).
    """
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _fix_moe_utils(module: ModuleType) -> None:
    # 0.16.1 binds te_general_gemm only inside `try: import transformer_engine`, but the router's
    # gating function reads it unconditionally -> NameError in every MoE forward without TE
    # (fixed upstream in 0.17). Only add it when absent: never shadow a real TE binding.
    if not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None
    module.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _fix_token_dispatcher(module: ModuleType) -> None:
    # token_dispatcher.py from-imports maybe_move_tensor_to_cpu: patch its copy too.
    module.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _fix_te_extensions(module: ModuleType) -> None:
    # Fine-grained activation offloading only needs TE's `cpu_offload` module as a holder of the
    # CPUOffloadEnabled flag (pipeline_parallel/fine_grained_activation_offload.py).
    if getattr(module, "cpu_offload", None) is None:
        module.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)


def _fix_mla_have_te(module: ModuleType) -> None:
    # 0.16.1 without Transformer Engine: MLA's import of the TE extensions succeeds (they stand
    # on a MagicMock ``te``), so it sets HAVE_TE = True and ``isinstance(linear_proj, TELinear)``
    # fails on a MagicMock at every MLA layer. Tell it the truth: no TE here.
    if getattr(module, "HAVE_TE", False) and importlib.util.find_spec("transformer_engine") is None:
        module.HAVE_TE = False


def _wrap_schedules_deallocate(module: ModuleType) -> None:
    original = module.deallocate_output_tensor

    def deallocate_output_tensor(out: Any, deallocate_pipeline_outputs: bool = False) -> None:
        """megatron's pseudo-free, keeping the old storage alive while sent buffers are kept.

        Still pseudo-frees (``custom_backward`` asserts ``numel() == 1``), but an in-flight gloo
        isend of the old storage no longer reads freed memory.
        """
        if not _KEEP_SENT_BUFFERS:
            return original(out, deallocate_pipeline_outputs)
        if out is None or not deallocate_pipeline_outputs:
            return None
        _SENT_BUFFERS.append(out.data)
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
        return None

    module.deallocate_output_tensor = deallocate_output_tensor
