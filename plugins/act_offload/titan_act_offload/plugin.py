"""Hook implementations of the ``act_offload`` plugin (entry point ``titan_plugins: act_offload``).

Never imports megatron (the patch factories get megatron's objects from the core's engine) and
does no device work at activation: the offloader is built on the first schedule call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_act_offload import config as _config
from titan_act_offload import runtime as _runtime

# the plan hook (titan_memory_effect) is registered with this module
from titan_act_offload.memory_effect import titan_memory_effect as titan_memory_effect
from titan_plugins import hookimpl


@hookimpl
def titan_register_patches(register: Callable[[Any], None]) -> None:
    """Declare the schedule and block patches (settings are read now, at activation)."""
    from titan_act_offload.wiring import patches

    runtime = _runtime.Runtime(_config.OffloadConfig.from_env())
    for record in patches(runtime):
        register(record)


@hookimpl
def titan_settings() -> list:
    """The ``TITAN_ACT_OFFLOAD_*`` knobs."""
    return _config.settings()


@hookimpl
def titan_configure(config: Any) -> None:
    """Say how megatron's own activation-memory features combine with this plugin."""
    runtime = _runtime.current()
    if runtime is None:
        return
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        runtime.warn_once(
            "ep_overlap",
            "act_offload: overlap_moe_expert_parallel_comm (combined 1F1B) is on; those "
            "schedules run without activation offload.",
        )
    if getattr(config, "fine_grained_activation_offloading", False) or getattr(
        config, "cpu_offloading", False
    ):
        runtime.warn_once(
            "megatron_offload",
            "act_offload: megatron's own activation offloading is on as well; tensors its "
            "hooks save are left to it, this plugin offloads the rest of the selected blocks.",
        )


@hookimpl
def titan_report() -> dict[str, Any]:
    """Settings and the byte counters of this process."""
    runtime = _runtime.current()
    if runtime is None:
        return {"active": False}
    report: dict[str, Any] = {
        "active": True,
        "modules": list(runtime.config.modules),
        "min_gap": runtime.config.min_gap,
        "max_host_bytes": runtime.config.max_host_bytes,
        "dry_run": runtime.config.dry_run,
    }
    if runtime._offloader is not None:
        report["stats"] = runtime.stats.as_dict()
        report["host_pool"] = runtime.offloader.pool.stats()
    return report


@hookimpl
def titan_doctor() -> list:
    """Host pinning and budget sanity."""
    from titan_plugins import platform
    from titan_plugins.doctor import OK, WARN, Check

    cfg = _config.OffloadConfig.from_env()
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
    if not cfg.modules:
        checks.append(
            Check(
                "act_offload.modules",
                WARN,
                "TITAN_ACT_OFFLOAD_MODULES selects no block: nothing will be offloaded",
                f"set it to some of {', '.join(_config.MODULES)}",
            )
        )
    return checks
