"""``titan-plugins doctor`` checks of the plugin, each problem with its fix."""

from __future__ import annotations

from titan_moe_ep_overlap import selection, settings
from titan_plugins import platform
from titan_plugins.doctor import FAIL, OK, WARN, Check


def check_deep_ep() -> Check:
    """Is DeepEP installed, and does it have the v1 API megatron-core 0.16 imports?"""
    if not selection.installed():
        return Check(
            "moe_ep_overlap.deep_ep", OK,
            "deep_ep not installed: the torch.distributed backend serves the flex dispatcher",
            "",
        )  # fmt: skip
    problem = selection.api_problem()
    if problem is None:
        return Check("moe_ep_overlap.deep_ep", OK, "deep_ep has the v1 API; it will be used")
    v2 = "EventOverlap" in problem
    return Check(
        "moe_ep_overlap.deep_ep", WARN,
        ("DeepEP v2 detected: " if v2 else "") + problem
        + "; megatron-core 0.16 cannot use it, the torch.distributed backend is used instead",
        "install DeepEP v1.x (tag v1.2.1) to use its kernels, or uninstall deep_ep to silence",
    )  # fmt: skip


def check_transport() -> Check:
    """Which collective backend the torch.distributed path will use."""
    device = platform.device_type()
    backend = platform.collective_backend(device)
    return Check("moe_ep_overlap.transport", OK, f"device {device}, collectives on {backend}")


def check_chunks() -> Check:
    """The pipeline knobs parse; what the MoE layers will do."""
    for knob in (settings.CHUNKS, settings.AUTO):
        problem = knob.problem()
        if problem:
            return Check("moe_ep_overlap.chunks", FAIL, problem, f"set {knob.name} to "
                         f"{knob.accepted()} (or unset it)")  # fmt: skip
    chunks = settings.CHUNKS.read()
    state = "off (1 chunk)" if chunks == 1 else f"{chunks} chunks"
    if chunks > 1 and settings.AUTO.read():
        state += ", kept per layer only where it measures faster than serial"
    return Check("moe_ep_overlap.chunks", OK, f"MoE layer pipeline: {state}")


def checks() -> list[Check]:
    """All checks of the plugin."""
    return [check_deep_ep(), check_transport(), check_chunks()]
