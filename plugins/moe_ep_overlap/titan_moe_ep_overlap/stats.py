"""What the plugin did in this process: counters of its DeepEP-API backend and chunk pipeline.

Kept apart (no torch, no megatron) so ``titan_report``, the public :func:`effects` accessor and the
demo read them without loading the backend. Counting is a few integer additions per MoE layer
call; the counters are per process (per rank) and never reset by themselves.
"""

from __future__ import annotations

from typing import Any

# Counter names, in report order, and what each counts.
FIELDS = {
    "api_dispatches": "DeepEP-API Buffer.dispatch calls served by our backend (any caller)",
    "api_combines": "DeepEP-API Buffer.combine calls served by our backend (any caller)",
    "layer_calls": "flex MoELayer forward calls seen by the plugin's forward",
    "pipelined_calls": "of those, calls that ran the chunked overlap pipeline",
    "serial_calls": "of those, calls left to megatron's unchunked flex path (1 chunk)",
    "upstream_calls": "of those, calls handed to megatron's own forward where it does what the "
    "pipeline does not (its own overlap or dispatcher: upstream_paths; its inference dispatcher)",
    "chunks": "token chunks the pipeline issued (forward)",
    "pipeline_dispatches": "dispatches the pipeline issued (forward + gradient re-dispatch)",
    "pipeline_combines": "combines the pipeline issued (forward + gradient combine)",
    "auto_decisions": "serial-vs-pipeline decisions taken by the automatic chooser",
    "auto_kept_pipeline": "of those, decisions that kept the pipeline (it measured faster)",
    "auto_chose_serial": "of those, decisions for the serial path (nothing to hide)",
}

_counts: dict[str, int] = dict.fromkeys(FIELDS, 0)
_PER_CALL = {"chunks": "chunks", "pipeline_dispatches": "dispatches",
             "pipeline_combines": "combines"}  # fmt: skip
_last: dict[str, int] = {}  # the most recent pipelined layer call (its forward and backward)


def add(name: str, amount: int = 1, call: dict[str, int] | None = None) -> None:
    """Count ``amount`` more of ``name`` (one of :data:`FIELDS`), also in a pipelined call's
    record (from :func:`start_pipelined_call`) when given."""
    _counts[name] += amount
    if call is not None:
        call[_PER_CALL[name]] += amount


def start_pipelined_call() -> dict[str, int]:
    """A pipelined layer call begins; returns its record, which its forward and its backward
    (later, interleaved with other layers' work) count into."""
    global _last
    _counts["pipelined_calls"] += 1
    _last = dict.fromkeys(_PER_CALL.values(), 0)
    return _last


def counts() -> dict[str, int]:
    """The totals only (flat, for the core's ``titan_effects``)."""
    return dict(_counts)


def snapshot() -> dict[str, Any]:
    """Totals, the per-call figures of the last pipelined call and per-call averages."""
    out: dict[str, Any] = dict(_counts)
    calls = _counts["pipelined_calls"]
    out["last_pipelined_call"] = dict(_last)
    if calls:
        out["per_pipelined_call"] = {
            "chunks": _counts["chunks"] / calls,
            "dispatches": _counts["pipeline_dispatches"] / calls,
            "combines": _counts["pipeline_combines"] / calls,
        }
    return out


def reset() -> None:
    """Zero every counter (tests, or a caller measuring one phase)."""
    global _last
    for name in _counts:
        _counts[name] = 0
    _last = {}
