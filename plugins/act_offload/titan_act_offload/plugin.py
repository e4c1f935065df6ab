"""Hook implementations of the ``act_offload`` plugin (entry point ``titan_plugins: act_offload``).

Light at import and at activation (both happen while Megatron imports): settings and patch
records only. The plan, the offloader and torch work load at the first training schedule, which
the core's ``titan_train_step`` hook announces; ``titan_forward_microbatch`` /
``titan_backward_microbatch`` say which (chunk, microbatch) unit runs.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from titan_act_offload import runtime as _runtime
from titan_act_offload.settings import SETTINGS, OffloadSettings
from titan_plugins import hookimpl


@hookimpl
def titan_register_patches(register: Callable[[Any], None]) -> None:
    """Declare the block patches (settings are read now, at activation)."""
    from titan_act_offload.block_patches import patches

    runtime = _runtime.Runtime(OffloadSettings.from_env())
    for record in patches(runtime):
        register(record)


@hookimpl
def titan_settings() -> list:
    """The ``TITAN_ACT_OFFLOAD_*`` knobs."""
    return list(SETTINGS)


@hookimpl(wrapper=True)
def titan_train_step(step: Any) -> Generator[None, Any, Any]:
    """Plan the offload of this schedule call (training only) and settle copies at its end."""
    runtime = _runtime.current()
    active = None
    if runtime is not None and runtime.blocks_patched:
        try:
            active = runtime.begin_step(step.schedule, step.kwargs)
        except Exception as err:  # never break training because the plan failed
            runtime.warn_once("plan", f"act_offload: no offload plan ({err!r}); running plain")
    if active is None:
        return (yield)
    try:
        return (yield)
    finally:
        runtime.end_step(active)


@hookimpl(wrapper=True)
def titan_forward_microbatch(call: Any) -> Generator[None, Any, Any]:
    """Tell the offloader which unit's forward runs (its saves belong to that unit)."""
    runtime = _runtime.current()
    step = runtime.step if runtime is not None else None
    if step is None:
        return (yield)
    state = step.begin_forward(call.model, call.vp_stage, call.input_tensor)
    output = None
    try:
        output = yield
        return output
    finally:
        step.end_forward(state, output[0] if isinstance(output, tuple) else output)


@hookimpl(wrapper=True)
def titan_backward_microbatch(call: Any) -> Generator[None, Any, Any]:
    """Tell the offloader which unit's backward runs (and prefetch as planned)."""
    runtime = _runtime.current()
    step = runtime.step if runtime is not None else None
    if step is None:
        return (yield)
    unit = step.begin_backward(call.output_tensor)
    try:
        return (yield)
    finally:
        step.end_backward(unit)


@hookimpl
def titan_memory_effect(layout: Any) -> Any:
    """What the plugin does to per-rank memory, for ``titan-plugins plan``
    (``memory_effect.py``: imported here, not while megatron loads)."""
    from titan_act_offload.memory_effect import titan_memory_effect as effect

    return effect(layout)


@hookimpl
def titan_configure(config: Any) -> None:
    """Say how megatron's own activation-memory features combine with this plugin (stepped
    aside, or composed with: ``upstream.py``), before the first schedule runs."""
    runtime = _runtime.current()
    if runtime is None:
        return
    from titan_act_offload.upstream import standing

    position = standing(config, runtime.settings.modules)
    runtime.upstream.note(position, counted=False)
    for flag, sentence in ((position.aside,) if position.aside else ()) + position.composes:
        runtime.warn_once(flag, f"act_offload: {sentence}")


@hookimpl
def titan_report() -> dict[str, Any]:
    """Whether the plugin acts (and ``inactive_reason`` when not), its settings, its counters
    (``stats``, ``host_pool``), where it stood aside for or composed with Megatron's own
    features (``stepped_aside``: schedule calls per flag, ``composes_with``: a sentence each),
    the saved tensors it left alone per reason (``skipped``), and why nothing was offloaded
    when nothing was."""
    runtime = _runtime.current()
    if runtime is None:
        return {"active": False, "inactive_reason": "not activated in this process"}
    why = _inactive_reason(runtime)
    report: dict[str, Any] = {"active": not why}
    if why:
        report["inactive_reason"] = why
    report.update(runtime.report())
    report["skipped"] = runtime.skipped()
    why_none = runtime.why_nothing_moved()
    if why_none:
        report["why_nothing_offloaded"] = why_none
    return report


@hookimpl
def titan_effects() -> dict[str, Any]:
    """What the plugin did in this process: bytes offloaded and reloaded, the peak of the stage's
    device-resident saved activations with and without offload (``peak_saved_bytes`` /
    ``peak_saved_bytes_without``), units offloaded, tensors skipped; ``stepped_aside`` /
    ``composes_with`` next to Megatron's own features (see ``Runtime.effects``)."""
    runtime = _runtime.current()
    return runtime.effects() if runtime is not None else {}


def _inactive_reason(runtime: _runtime.Runtime) -> str:
    """Empty when the plugin can act: a block forward is wrapped and the core's training-loop
    hooks are in place; else what stops it (e.g. an unsupported megatron-core)."""
    if not runtime.settings.modules:
        return "TITAN_ACT_OFFLOAD_MODULES selects no block"
    if not runtime.started and runtime.upstream.reason():
        return runtime.upstream.reason()  # stood aside for Megatron's own feature (upstream.py)
    from titan_plugins.activation import active
    from titan_plugins.patching import APPLIED, OTHER_LINE, PENDING

    state = active()
    patches = state.engine.patches() if state is not None and state.engine is not None else []
    hooks = [p for p in patches if p.id.startswith(_CORE_HOOK_PATCHES)]
    # A hook written for another Megatron line (e.g. 0.19's multi-module backward) is not missing.
    missing = next((p for p in hooks if p.status not in (APPLIED, PENDING, OTHER_LINE)), None)
    if missing is not None:
        return f"the core's training-loop hook {missing.id} is {missing.status}: {missing.detail}"
    if runtime.blocks_patched:
        return ""
    mine = [p for p in patches if p.plugin == "act_offload"]
    if mine and all(p.status == PENDING for p in mine):
        return "waiting for megatron-core's transformer modules to be imported"
    skipped = next((p for p in mine if p.status != APPLIED), None)
    detail = f"{skipped.status}: {skipped.detail}" if skipped is not None else "none registered"
    return f"no block patch applies ({detail})"


# The core's records the plugin relies on (schedule calls and each microbatch's forward/backward).
_CORE_HOOK_PATCHES = ("core.train_step.", "core.forward_microbatch", "core.backward_microbatch")


@hookimpl
def titan_doctor() -> list:
    """Host pinning and budget sanity."""
    from titan_plugins import platform
    from titan_plugins.doctor import OK, WARN, Check

    settings = OffloadSettings.from_env()
    checks = []
    if platform.pin_memory_supported():
        checks.append(Check("act_offload.pinned_host", OK, "pinned host buffers available"))
    else:
        checks.append(
            Check(
                "act_offload.pinned_host",
                WARN,
                "no accelerator: host copies are synchronous memcpys (CPU testing only)",
                "run on a CUDA/MUSA device for copy/compute overlap",
            )
        )
    if not settings.modules:
        checks.append(
            Check(
                "act_offload.modules",
                WARN,
                "TITAN_ACT_OFFLOAD_MODULES selects no block: nothing will be offloaded",
                "set it to some of attention, mlp, moe, experts, layer",
            )
        )
    return checks
