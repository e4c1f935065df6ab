"""Record a Kineto trace of chosen training iterations on every rank (``TITAN_TRACE_STEPS``).

Megatron's ``get_forward_backward_func`` returns one of the ``forward_backward_*`` functions of
``megatron.core.pipeline_parallel.schedules``, looked up in that module's globals at call time,
and every training iteration calls it once (``forward_only=False``).  The plugin wraps those
functions: a call opens iteration N (closing N-1, so each ``ProfilerStep#N`` also covers the
optimizer step that follows the schedule), the profiler starts at the first iteration of the
range and stops, and exports ``<TITAN_TRACE_DIR>/rank-<R>.json.gz``, when the iteration after
the range begins (or at exit).  The rank's parallel coordinates from
``megatron.core.parallel_state`` go into the trace as ``titan_parallel`` metadata, next to
PyTorch's own ``distributedInfo``.  Any failure here is logged and training goes on untraced.
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

log = logging.getLogger("titan_plugins.trace_analysis")


def parse_steps(text: str) -> tuple[int, int] | None:
    """``"10-12"`` -> (10, 12), ``"7"`` -> (7, 7), ``""`` -> None; ValueError names the form."""
    text = text.strip()
    if not text:
        return None
    lo, sep, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"TITAN_TRACE_STEPS={text!r}: use FIRST-LAST or N, e.g. 10-12") from None
    if first < 0 or last < first:
        raise ValueError(f"TITAN_TRACE_STEPS={text!r}: need 0 <= FIRST <= LAST, e.g. 10-12")
    return first, last


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

    def _close_step(self) -> None:
        if self.step_rec is not None:
            self.step_rec.__exit__(None, None, None)
            self.step_rec = None

    def _start(self) -> None:
        import torch

        self.prof = torch.profiler.profile(activities=list(torch.profiler.supported_activities()))
        self.prof.start()
        self.prof.add_metadata_json("titan_parallel", json.dumps(parallel_coordinates()))
        atexit.register(self.finish)

    def finish(self) -> None:
        """Stop the profiler and write this rank's trace (idempotent)."""
        if self.prof is None or self.done:
            return
        self.done = True
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
    """The capture of this process (created from the environment on first use), or None."""
    global _CURRENT
    if _CURRENT is None:
        from titan_plugins.settings import complain, env_bool

        try:
            rng = parse_steps(os.environ.get("TITAN_TRACE_STEPS", ""))
        except ValueError as exc:
            complain(str(exc))
            rng = None
        if rng is None:
            return None
        out_dir = os.environ.get("TITAN_TRACE_DIR", "").strip() or "titan_traces"
        _CURRENT = StepCapture(rng[0], rng[1], out_dir, env_bool("TITAN_TRACE_GZIP", True))
    return _CURRENT


def reset() -> None:
    """Forget the capture of this process (tests; a new run re-reads the environment)."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.finish()
    _CURRENT = None


def wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory for ``schedules.forward_backward_*``: one call = one training iteration."""

    @functools.wraps(original)
    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("forward_only", False):
            from titan_plugins.settings import SettingError

            try:
                cap = current()
                if cap is not None:
                    cap.on_call()
            except SettingError:
                raise  # TITAN_PLUGINS_STRICT=1 asked for bad settings to stop the run
            except Exception as exc:  # never break training because tracing failed
                log.warning("trace_analysis: capture disabled after error: %s", exc)
                global _CURRENT
                _CURRENT = StepCapture(0, -1, "")
                _CURRENT.done = True
        return original(*args, **kwargs)

    forward_backward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward_backward
