"""Example plugin: marks ``megatron.core.parallel_state.initialize_model_parallel`` and
implements every Titan hook except the training-loop wrappers (tests/test_core_hooks.py wraps
those), so tests can see each channel and hook do its job. Its knob is a typed Setting."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from titan_plugins import hookimpl
from titan_plugins.doctor import OK, Check
from titan_plugins.patching import Patch
from titan_plugins.settings import Setting

CALLS: list[str] = []
SEEN_CONFIGS: list[Any] = []
MARK = "_titan_example"
GREETING = Setting(
    "TITAN_EXAMPLE_GREETING", str, "hello", "What titan_report says.", choices=("hello", "hi")
)
SETTINGS = [GREETING]


def _mark(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        CALLS.append("initialize_model_parallel")
        return original(*args, **kwargs)

    setattr(initialize_model_parallel, MARK, True)
    return initialize_model_parallel


@hookimpl
def titan_register_patches(register: Callable[[Patch], None]) -> None:
    """Wrap initialize_model_parallel so a test can see the patch from any process."""
    register(
        Patch(
            id="example.mark_initialize_model_parallel",
            target="megatron.core.parallel_state:initialize_model_parallel",
            replace=_mark,
            requires=("megatron-core>=0.16",),
            rationale="Observable marker for the registry's end-to-end tests.",
            upstream="megatron/core/parallel_state.py initialize_model_parallel",
            remove_when="never: test fixture",
        )
    )


@hookimpl
def titan_settings() -> list[Setting]:
    """One knob, to show declared settings in ``titan-plugins env``."""
    return SETTINGS


@hookimpl
def titan_add_arguments(group: Any) -> None:
    """Add ``--titan-example-flag``."""
    group.add_argument("--titan-example-flag", type=int, default=0)


@hookimpl
def titan_configure(config: Any) -> None:
    """Remember every config seen."""
    SEEN_CONFIGS.append(config)


@hookimpl
def titan_moe_dispatcher(config: Any) -> Any:
    """Offer a backend only when asked for it by name."""
    return "example-dispatcher" if getattr(config, "example_backend", False) else None


@hookimpl
def titan_p2p_communicator(config: Any) -> Any:
    """Offer a communicator only when asked for it by name."""
    return "example-p2p" if getattr(config, "example_backend", False) else None


@hookimpl
def titan_report() -> dict[str, Any]:
    """State for ``titan-plugins list``."""
    return {
        "greeting": GREETING.read(),
        "calls": len(CALLS),
    }


@hookimpl
def titan_doctor() -> list[Check]:
    """A check that always passes, to show plugin checks in ``doctor``."""
    return [Check("example", OK, "example plugin is healthy")]


@hookimpl
def titan_effects() -> dict[str, Any]:
    """What the plugin did here: how often the marked function ran in this process."""
    return {"initialize_model_parallel_calls": len(CALLS)}
