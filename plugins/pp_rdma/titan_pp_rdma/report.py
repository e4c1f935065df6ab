"""What ``titan-plugins report`` / ``doctor`` say about pp_rdma."""

from __future__ import annotations

from typing import Any

from titan_pp_rdma import job_communicator, security
from titan_pp_rdma.mooncake_engine import rdma_nics, resolve_protocol
from titan_pp_rdma.probe import probe_mooncake
from titan_pp_rdma.session import STATE
from titan_pp_rdma.settings import PPRdmaSettings


def expected_backend(settings: PPRdmaSettings) -> tuple[str, str]:
    """The backend a new session would choose on this rank, and why."""
    if settings.backend == "torch":
        return "torch", "TITAN_PP_RDMA_BACKEND=torch"
    probe = probe_mooncake()
    if not probe.available:
        return "torch", f"Mooncake unavailable: {probe.detail} (fix: {probe.fix})"
    protocol = resolve_protocol(settings.protocol)
    return "mooncake", f"mooncake {protocol} ({settings.metadata})"


def report() -> dict[str, Any]:
    """Backend in use (after the first pipeline step) or expected (before), with the reason."""
    settings = PPRdmaSettings.from_env()
    backend, why = expected_backend(settings)
    state: dict[str, Any] = {"backend": backend, "why": why, "active": False}
    if STATE.last:
        state = {**STATE.last, "active": True}
    aside = job_communicator.reason()
    if aside:  # some schedule calls carried the job's own communicator, not pp_rdma's
        state["inactive_reason" if not STATE.last else "own_communicator"] = aside
    served = job_communicator.served()
    if served:
        state["job_communicator_calls_served"] = served
    if STATE.engine_error:
        state["engine_error"] = STATE.engine_error
    state["timeout_s"] = settings.timeout_s
    if STATE.engine is not None:
        state["listeners"] = STATE.engine.listeners
        for name, msg in STATE.engine.drain_notifies():  # pp_rdma sends none
            security.reject("mooncake_notification", f"name {name[:80]!r} msg {msg[:80]!r}")
    # Control input that failed authentication or validation (never acted on), by reason.
    state["rejected"] = security.rejected()
    return state


def doctor_checks() -> list[Any]:
    """Capability checks, each with its fix."""
    from titan_plugins.doctor import FAIL, OK, WARN, Check

    settings = PPRdmaSettings.from_env()
    probe = probe_mooncake()
    checks = [
        Check(
            "pp_rdma.mooncake",
            OK if probe.available else WARN,
            probe.detail if probe.available else f"{probe.detail}: torch.distributed fallback",
            "" if probe.available else probe.fix,
        )
    ]
    if settings.backend == "mooncake" and not probe.available:
        checks.append(
            Check(
                "pp_rdma.backend",
                FAIL,
                "TITAN_PP_RDMA_BACKEND=mooncake but Mooncake is unavailable",
                probe.fix,
            )
        )
    nics = rdma_nics()
    protocol = resolve_protocol(settings.protocol)
    if settings.protocol == "rdma" and not nics:
        checks.append(
            Check(
                "pp_rdma.protocol",
                FAIL,
                "TITAN_PP_RDMA_PROTOCOL=rdma but /sys/class/infiniband lists no device",
                "install the NIC driver / rdma-core, or set TITAN_PP_RDMA_PROTOCOL=tcp",
            )
        )
    else:
        detail = f"protocol {protocol}; RDMA devices: {', '.join(nics) or 'none'}"
        checks.append(Check("pp_rdma.protocol", OK, detail))
    backend, why = expected_backend(settings)
    checks.append(Check("pp_rdma.backend", OK, f"{backend}: {why}"))
    return checks
