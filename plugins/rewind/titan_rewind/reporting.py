"""What one process's rewind state machine reports: the flat ``titan_effects`` numbers and the
fuller per-rank record the demo's table and ``titan_report`` show."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from titan_rewind import inject, loop

if TYPE_CHECKING:
    from titan_rewind.runtime import Rewinder


def effects(rewinder: Rewinder) -> dict[str, int | float]:
    """Flat numbers of what happened in this process (empty before the first step)."""
    if not rewinder.steps_checked:
        return {}
    store = rewinder.store_if_built
    events = rewinder.events
    out: dict[str, int | float] = {
        "steps_checked": rewinder.steps_checked,
        "rewinds": len(events),
        "snapshots_taken": store.taken if store is not None else 0,
        "snapshots_held": len(store.held()) if store is not None else 0,
        "host_bytes": store.host_bytes() if store is not None else 0,
        "microbatches_skipped": sum(e.microbatches_skipped for e in events),
        "extra_microbatches_dropped": sum(e.extra_microbatches_dropped for e in events),
        "restore_ms": round(sum(e.seconds for e in events) * 1e3, 3),
    }
    if events:
        out["last_rewind_step"] = events[-1].step
        out["last_restored_step"] = events[-1].snapshot_step
    return out


def effect(rewinder: Rewinder) -> dict[str, Any]:
    """This rank's record: the rollbacks, the triggers left unhandled, the stable target and
    the thresholds, and what the snapshot store holds."""
    store = rewinder.store_if_built
    stable = store.rollback_target() if store is not None else None
    held = store.describe() if store is not None else loop.no_store(rewinder.config)
    return {
        "steps_checked": rewinder.steps_checked,
        "rewinds": len(rewinder.events),
        "events": [_finite_or_text(asdict(e)) for e in rewinder.events],
        "unhandled_triggers": list(rewinder.unhandled),
        "skipped_by_loss_scaler": rewinder.steps_skipped_by_scaler,
        "stable_snapshot_step": None if stable is None else stable.step,
        "thresholds": rewinder.detector.thresholds(),
        "injected_nan_steps": sorted(inject.fired()),
        **held,
    }


def _finite_or_text(event: dict[str, Any]) -> dict[str, Any]:
    """NaN / Inf values as text (``"nan"``), so reports stay strict JSON."""
    return {
        k: repr(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in event.items()
    }
