"""``titan-plugins doctor``: environment checks, each problem with its fix."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from titan_plugins.patching import gates

OK, WARN, FAIL = "ok", "warn", "fail"
SUPPORTED_MEGATRON = ">=0.16,<0.17"


@dataclass(frozen=True)
class Check:
    """One doctor line: what was checked, the verdict, what was seen, how to fix it."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        return asdict(self)


def check_torch() -> Check:
    """torch >= 2.5 is needed for the torch.backends autoload channel."""
    version = gates.installed_version("torch")
    if version is None:
        return Check("torch", FAIL, "torch is not installed", "pip install torch>=2.5")
    if gates.version_key(version) < gates.version_key("2.5"):
        return Check(
            "torch",
            WARN,
            f"torch {version} has no torch.backends autoload",
            "upgrade torch to >= 2.5, or launch with titan-run",
        )
    return Check("torch", OK, f"torch {version}")


def check_autoload(state: dict[str, Any]) -> Check:
    """Is the automatic channel on, registered, and did it run here?"""
    value = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
    if value is not None and value != "1":
        return Check(
            "autoload",
            WARN,
            f"TORCH_DEVICE_BACKEND_AUTOLOAD={value!r} turns off every torch.backends extension "
            "(children inherit it)",
            "unset it, or launch with titan-run, or call titan_plugins.apply()",
        )
    names = [ep.value for ep in metadata.entry_points(group="torch.backends")]
    if not any(v.startswith("titan_entrypoints") for v in names):
        return Check(
            "autoload",
            FAIL,
            "titan-plugins' torch.backends entry point is not registered",
            "reinstall titan-plugins",
        )
    if os.environ.get("TITAN_PLUGINS_AUTOLOAD", "1").strip().lower() in ("0", "false", "no", "off"):
        return Check(
            "autoload",
            WARN,
            "TITAN_PLUGINS_AUTOLOAD=0: only explicit apply() activates",
            "unset TITAN_PLUGINS_AUTOLOAD",
        )
    return Check("autoload", OK, f"on; in this process: {state.get('state')}")


def check_megatron() -> Check:
    """megatron-core inside the range the plugins were tested against."""
    version = gates.installed_version("megatron-core")
    if version is None:
        return Check(
            "megatron-core",
            WARN,
            "megatron-core distribution not found (a Megatron-LM checkout on PYTHONPATH has no metadata)",
            "pip install megatron-core matching your checkout, so version gates can be checked",
        )
    reason = gates.check(f"megatron-core{SUPPORTED_MEGATRON}")
    if reason:
        return Check(
            "megatron-core",
            WARN,
            reason,
            f"use megatron-core{SUPPORTED_MEGATRON}, or expect patches to be skipped",
        )
    return Check("megatron-core", OK, f"megatron-core {version} (supported {SUPPORTED_MEGATRON})")


def check_platform() -> Check:
    """Which device and collective backend this process would use."""
    from titan_plugins import platform

    try:
        device = platform.device_type()
    except Exception as err:
        return Check(
            "platform", FAIL, f"device probe failed: {err}", "check the torch / torch_musa install"
        )
    return Check(
        "platform", OK, f"device {device}, collectives {platform.collective_backend(device)}"
    )


def core_checks(autoload_state: dict[str, Any]) -> list[Check]:
    """All core checks, in display order."""
    return [check_torch(), check_autoload(autoload_state), check_megatron(), check_platform()]
