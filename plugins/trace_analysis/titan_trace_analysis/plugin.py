"""Hook implementations of trace_analysis (the entry-point target).

Never imports megatron: the patch factory runs when ``megatron.core.pipeline_parallel.schedules``
has executed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.patching import SUPPORTED_MEGATRON, Patch, Signature
from titan_plugins.settings import Setting

from . import capture

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Wrap the three schedules; they only act when TITAN_TRACE_STEPS is set."""
    for fn in FUNCTIONS:
        register(
            Patch(
                id=f"trace_analysis.{fn}",
                target=f"{SCHEDULES}:{fn}",
                replace=capture.wrap_schedule,
                requires=SUPPORTED_MEGATRON,
                signature=Signature(params=("forward_step_func", "forward_only")),
                rationale="one schedule call = one training iteration: start/stop the profiler "
                "on the iterations named by TITAN_TRACE_STEPS and label them ProfilerStep#N",
                upstream="megatron/core/pipeline_parallel/schedules.py: get_forward_backward_func "
                "returns these module globals at call time",
                remove_when="megatron-core exposes a per-iteration hook or profiler range for "
                "unmodified training loops",
            )
        )


@hookimpl
def titan_settings() -> list[Setting]:
    """Capture knobs (analysis options are command-line flags of titan-trace)."""
    return [
        Setting("TITAN_TRACE_STEPS", "", "Iterations to trace on every rank: FIRST-LAST or N."),
        Setting("TITAN_TRACE_DIR", "titan_traces", "Folder for rank-<R>.json.gz (shared storage)."),
        Setting("TITAN_TRACE_GZIP", "1", "1: write gzipped traces; 0: plain JSON.", ("0", "1")),
    ]


@hookimpl
def titan_report() -> dict[str, Any]:
    """Capture state for `titan-plugins list`."""
    try:
        cap = capture.current()
    except Exception as exc:  # a report must not fail (e.g. a bad value under STRICT)
        return {"capture": f"error: {exc}"}
    if cap is None:
        return {"capture": "off (TITAN_TRACE_STEPS unset)"}
    return {
        "capture": f"iterations {cap.first}-{cap.last}",
        "dir": cap.out_dir,
        "written": cap.path or "",
    }
