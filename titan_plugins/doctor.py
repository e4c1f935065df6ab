"""``titan-plugins doctor``: environment checks, each problem with its fix."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from titan_plugins import import_replay
from titan_plugins.hosts import HOSTS
from titan_plugins.patching import gates, origin

MEGATRON = HOSTS["megatron"]

OK, WARN, FAIL = "ok", "warn", "fail"


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


def check_megatron(found: origin.Origin | None = None) -> Check:
    """The megatron.core this process imports: where from, and is its version supported?

    Read from the code (``megatron.core.package_info`` of the package found on the import
    path), as the version gates do; megatron is not imported for it.
    """
    found = found or origin.describe(MEGATRON.PACKAGE, MEGATRON.DISTRIBUTION)
    spec = MEGATRON.SUPPORTED
    if found.kind == origin.ABSENT:
        return Check(
            "megatron-core",
            WARN,
            "megatron.core is not importable here",
            "pip install megatron-core, or put a Megatron-LM checkout on PYTHONPATH",
        )
    if found.version is None:
        return Check(
            "megatron-core",
            WARN,
            f"{found.summary()}: no version in its package_info.py",
            "use a megatron-core release or a Megatron-LM release tag; patches will be skipped",
        )
    verdict = gates.judge_version(spec, found.version)
    if verdict.reason:
        return Check(
            "megatron-core",
            WARN,
            f"{found.summary(shadows=False)}: outside the supported {spec}",
            f"use {spec}, or expect patches to be skipped",
        )
    if verdict.provisional:
        return Check(
            "megatron-core",
            WARN,
            f"{found.summary(shadows=False)}: a pre-release of the supported {spec}; a patch "
            "applies only where its signature checks pass",
            "see `titan-plugins list --import-targets` for what was skipped, or use a release",
        )
    return Check("megatron-core", OK, f"{found.summary(shadows=False)} (supported {spec})")


def check_megatron_shadowing(found: origin.Origin | None = None) -> Check | None:
    """An installed megatron-core that is not the code being imported (a checkout on
    ``PYTHONPATH`` in front of a wheel): tools that read metadata see the wrong version."""
    found = found or origin.describe(MEGATRON.PACKAGE, MEGATRON.DISTRIBUTION)
    if not found.shadowed:
        return None
    return Check(
        "megatron-shadowed",
        WARN,
        f"imported {found.summary()}",
        "uninstall the shadowed distribution (pip uninstall megatron-core) or drop the "
        "checkout from PYTHONPATH, so one Megatron is installed",
    )


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
    found = origin.describe(MEGATRON.PACKAGE, MEGATRON.DISTRIBUTION)
    checks = [check_torch(), check_autoload(autoload_state), check_megatron(found)]
    shadowing = check_megatron_shadowing(found)
    return [*checks, *([shadowing] if shadowing else []), check_platform()]


def import_checks(
    timeout_s: float = import_replay.DEFAULT_TIMEOUT_S,
    entry_points: list[metadata.EntryPoint] | None = None,
) -> tuple[list[tuple[str, Check]], str]:
    """``doctor --imports``: one check per plugin the manager would import, each imported alone
    in its own process, and the summary line (which plugins end or hang the process, or that
    all N import)."""
    outcomes, disabled = import_replay.replay(entry_points, timeout_s)
    checks = []
    for outcome in outcomes:
        fix = ""
        if not outcome.ok:
            fix = (
                f"TITAN_PLUGINS_DISABLE={outcome.name} runs without it; report it to "
                f"{outcome.distribution or outcome.value}"
            )
        status = OK if outcome.ok else FAIL
        checks.append(
            (outcome.name, Check("import", status, f"{outcome.who}: {outcome.detail}", fix))
        )
    bad = [o.name for o in outcomes if not o.ok]
    left_out = f" ({disabled} switched off, not imported)" if disabled else ""
    if not outcomes:
        summary = f"no plugin to import (none installed, or the switches leave each out){left_out}"
    elif not bad:
        summary = f"all {len(outcomes)} plugins import, each alone in its own process{left_out}"
    else:
        summary = (
            f"{len(bad)} of {len(outcomes)} plugins fail their import alone (above): "
            f"{', '.join(bad)}; TITAN_PLUGINS_DISABLE={','.join(bad)} runs without them"
        )
    return checks, summary
