"""Record a Kineto trace of chosen training iterations on every rank (``TITAN_TRACE_STEPS``).

The core calls the ``titan_train_step`` wrapper hook around every call of Megatron's
``forward_backward_*`` schedule; each training call (not ``step.forward_only``) opens iteration
N, closing N-1, so each ``ProfilerStep#N`` also covers the optimizer step that follows the
schedule.  The profiler starts at the first iteration of the range and stops, and exports
``<TITAN_TRACE_DIR>/rank-<R>.json.gz``, when the iteration after the range begins (or at exit).
The rank's parallel coordinates from ``megatron.core.parallel_state`` go into the trace as
``titan_parallel`` metadata, next to PyTorch's own ``distributedInfo``.  While recording,
Megatron's pipeline P2P calls carry ``titan.p2p:<method>`` titles, so the analyzer knows each
transfer's direction even without collective args (and on CPU runs, where P2P has no kernel).
Any failure here is logged and training goes on untraced.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from .settings import DIR, GZIP, STEPS, parse_steps

log = logging.getLogger("titan_plugins.trace_analysis")
P2P_TITLE = "titan.p2p:"
_RECORDING = False  # a profiler of this process is running: P2P calls get titles


def parallel_coordinates() -> dict[str, int]:
    """This rank's coordinates from megatron.core.parallel_state (empty if not initialised)."""
    import torch.distributed as dist

    out: dict[str, int] = {}
    if dist.is_available() and dist.is_initialized():
        out["rank"], out["world_size"] = dist.get_rank(), dist.get_world_size()
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return out
    getters = {
        "pp": ps.get_pipeline_model_parallel_rank,
        "pp_size": ps.get_pipeline_model_parallel_world_size,
        "tp": ps.get_tensor_model_parallel_rank,
        "tp_size": ps.get_tensor_model_parallel_world_size,
        "ep": ps.get_expert_model_parallel_rank,
        "ep_size": ps.get_expert_model_parallel_world_size,
        "dp": ps.get_data_parallel_rank,
        "dp_size": ps.get_data_parallel_world_size,
        "edp": ps.get_expert_data_parallel_rank,
        "edp_size": ps.get_expert_data_parallel_world_size,
        "vpp_size": ps.get_virtual_pipeline_model_parallel_world_size,
    }
    for key, get in getters.items():
        try:
            value = get()
        except (AssertionError, AttributeError, RuntimeError):
            continue
        if value is not None:
            out[key] = int(value)
    try:
        out["ep_group"] = min(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))
    except (AssertionError, AttributeError, RuntimeError, ValueError):
        pass
    return out


class StepCapture:
    """Profiler state machine over training iterations ``first..last`` (inclusive)."""

    def __init__(self, first: int, last: int, out_dir: str, gz: bool = True) -> None:
        self.first, self.last, self.out_dir, self.gz = first, last, out_dir, gz
        self.calls = 0
        self.prof: Any = None
        self.step_rec: Any = None
        self.done = False
        self.path: str | None = None
        self.traced = 0  # iterations recorded

    def iteration(self) -> int:
        """Megatron's iteration number of the call now starting (1-based, as it logs them)."""
        self.calls += 1
        gv = sys.modules.get("megatron.training.global_vars")
        args = getattr(gv, "_GLOBAL_ARGS", None) if gv else None
        cur = getattr(args, "curr_iteration", None)
        return int(cur) + 1 if isinstance(cur, int) else self.calls

    def on_call(self) -> None:
        """A training iteration begins: close the previous one, start/stop as the range says."""
        if self.done:
            return
        step = self.iteration()
        self._close_step()
        if self.prof is not None and step > self.last:
            self.finish()
            return
        if self.prof is None and self.first <= step <= self.last:
            self._start()
        if self.prof is not None:
            import torch

            self.step_rec = torch.profiler.record_function(f"ProfilerStep#{step}")
            self.step_rec.__enter__()
            self.traced += 1

    def _close_step(self) -> None:
        if self.step_rec is not None:
            self.step_rec.__exit__(None, None, None)
            self.step_rec = None

    def _start(self) -> None:
        global _RECORDING
        import torch

        self.prof = torch.profiler.profile(activities=list(torch.profiler.supported_activities()))
        self.prof.start()
        _RECORDING = True
        self.prof.add_metadata_json("titan_parallel", json.dumps(parallel_coordinates()))
        atexit.register(self.finish)

    def finish(self) -> None:
        """Stop the profiler and write this rank's trace (idempotent)."""
        global _RECORDING
        if self.prof is None or self.done:
            return
        self.done = True
        _RECORDING = False
        self._close_step()
        prof, self.prof = self.prof, None
        prof.stop()
        rank = parallel_coordinates().get("rank", 0)
        os.makedirs(self.out_dir, exist_ok=True)
        name = f"rank-{rank}.json" + (".gz" if self.gz else "")
        self.path = os.path.join(self.out_dir, name)
        prof.export_chrome_trace(self.path)
        log.info("trace_analysis: wrote %s", self.path)


_CURRENT: StepCapture | None = None


def current() -> StepCapture | None:
    """The capture of this process (created from the environment on first use), or None.

    A malformed TITAN_TRACE_STEPS warns and traces nothing (SettingError under STRICT).
    """
    global _CURRENT
    if _CURRENT is None:
        rng = parse_steps(STEPS.read())
        if rng is None:
            return None
        _CURRENT = StepCapture(rng[0], rng[1], DIR.read().strip() or "titan_traces", GZIP.read())
    return _CURRENT


def existing() -> StepCapture | None:
    """The capture of this process if one was created (never reads the environment)."""
    return _CURRENT


def reset() -> None:
    """Forget the capture of this process (tests; a new run re-reads the environment)."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.finish()
    _CURRENT = None


def on_train_step(forward_only: bool) -> None:
    """Called before every schedule call; never raises except SettingError under STRICT."""
    global _CURRENT
    if forward_only:
        return  # evaluation passes are not iterations
    from titan_plugins.settings import SettingError

    try:
        cap = current()
        if cap is not None:
            cap.on_call()
    except SettingError:
        raise  # TITAN_PLUGINS_STRICT=1 asked for bad settings to stop the run
    except Exception as exc:  # never break training because tracing failed
        log.warning("trace_analysis: capture disabled after error: %s", exc)
        _CURRENT = StepCapture(0, -1, "")
        _CURRENT.done = True


def wrap_p2p(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory for a ``P2PCommunicator`` method: a ``titan.p2p:<method>`` title while a
    capture records (one flag test otherwise)."""
    title = P2P_TITLE + original.__name__

    @functools.wraps(original)
    def p2p(*args: Any, **kwargs: Any) -> Any:
        if not _RECORDING:
            return original(*args, **kwargs)
        import torch

        with torch.profiler.record_function(title):
            return original(*args, **kwargs)

    return p2p
