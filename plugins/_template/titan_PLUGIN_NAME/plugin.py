"""Hook implementations of PLUGIN_NAME (the entry-point target). Never import megatron here:
patch factories run when their target module has executed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.patching import SUPPORTED_MEGATRON, Patch
from titan_plugins.settings import Setting


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement factory: receives the current value, returns the replacement."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Declare this plugin's patches (target where the name is used)."""
    register(
        Patch(
            id="PLUGIN_NAME.example",
            target="megatron.core.parallel_state:initialize_model_parallel",
            replace=_wrap,
            requires=SUPPORTED_MEGATRON,
            rationale="why this patch exists",
            upstream="the upstream code it changes",
            remove_when="when upstream makes it unnecessary",
        )
    )


@hookimpl
def titan_settings() -> list[Setting]:
    """This plugin's knobs."""
    return []


@hookimpl
def titan_report() -> dict[str, Any]:
    """State for `titan-plugins list`."""
    return {}
