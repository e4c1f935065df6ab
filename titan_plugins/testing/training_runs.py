"""The training runs of ``titan-plugins verify``'s differential check, on one gloo worker.

Each run trains the core's tiny MoE GPT (:mod:`~titan_plugins.hosts.megatron.testing.tiny_gpt`:
megatron's own model, schedules, ``finalize_model_grads`` and optimizer, on CPU with the
harness) from the layout's seeded weights, with exactly the given plugins applied, and returns
what the judge needs: the losses and grad norms of each step, the change of every plugin's
``titan_effects`` over the run, and the patches that failed.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STEPS, MICROBATCHES = 2, 4
BASE_CONFIG: dict[str, Any] = {
    "bf16": True,
    "hidden_size": 128,
    "ffn_hidden_size": 256,
    "moe_router_dtype": "fp32",
}
"""bf16 as production trains (FP8 recipes need it); 128 so blockwise FP8 has whole tiles; the
router in fp32 in every run (the flex dispatcher needs it), so a dispatcher's run differs from
the off run only by the dispatcher."""
VPP_CONFIG: dict[str, Any] = {"batch_p2p_comm": False}
"""megatron's batched P2P swaps tensors under PP=2 with VPP (tiny_gpt.make_config); the check
judges plugins, not that upstream bug."""
SCRATCH = "{scratch}"
"""In a plugin's ``env`` values: replaced by a fresh folder per run (e.g. a trace folder)."""
CHECKOUT_ENV = "TITAN_VERIFY_MEGATRON_LM"
"""The Megatron-LM checkout the workers must import megatron from, set in the parent while its
pools start: the fork server of a preloaded pool puts it first on its ``sys.path`` before it
imports megatron.core (``_worker_preload``; CPython 3.12's fork server does not take the
parent's ``sys.path``)."""


def imported_megatron(checkout: str | None = None) -> str:
    """Which Megatron this process imports: ``megatron-core <version> from <folder>``.

    :param checkout: a Megatron-LM checkout whose ``megatron`` this process must have imported.
    :raises RuntimeError: megatron.core came from elsewhere (e.g. the installed wheel), so a
        verdict here would be about another Megatron.
    """
    import megatron.core
    from megatron.core import package_info

    module = Path(megatron.core.__file__)
    seen = f"megatron-core {package_info.__version__} from {module.parent.parent.parent}"
    # resolved on both sides: a checkout whose megatron/ is a link to a tree is that tree
    if checkout is not None and not module.resolve().is_relative_to(
        (Path(checkout) / "megatron").resolve()
    ):
        raise RuntimeError(
            f"this worker imported {seen}, not the megatron of the checkout {checkout}: put the "
            f"checkout first on the path (PYTHONPATH={checkout})"
        )
    return seen


def _numbers(found: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a plugin's effects (``a.b`` for nested keys)."""
    out: dict[str, float] = {}
    if isinstance(found, dict):
        for key, value in found.items():
            out.update(_numbers(value, f"{prefix}{key}."))
    elif isinstance(found, (int, float)) and not isinstance(found, bool):
        out[prefix[:-1]] = float(found)
    elif isinstance(found, (list, tuple)):
        out[prefix[:-1] + ".len"] = float(len(found))
    return out


def run_task(
    layout: dict[str, Any],
    runs: list[tuple[str, list[str]]],
    plugin_specs: dict[str, Any],
    checkout: str | None = None,
) -> dict[str, Any]:
    """Worker task: train once per run; each run's losses, norms, effects change and failed
    patches on this rank.

    :param checkout: the Megatron-LM checkout the worker must have imported megatron from
        (:func:`imported_megatron` raises before any training otherwise).
    """
    import torch

    out: dict[str, Any] = {
        "rank": torch.distributed.get_rank(),
        "megatron": imported_megatron(checkout),
    }
    for name, plugins in runs:
        try:
            out[name] = _one_run(layout, plugins, plugin_specs)
        except Exception as err:  # name the run: the pool re-raises it in the parent
            raise RuntimeError(
                f"training run {name!r} failed: {type(err).__name__}: {err}"
            ) from err
    return out


def _one_run(
    layout: dict[str, Any], plugins: list[str], plugin_specs: dict[str, Any]
) -> dict[str, Any]:
    """One training run on this rank, from the layout's seeded initial weights."""
    from titan_plugins import report
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    parallel = {key: value for key, value in layout.items() if key != "model"}
    model = str(layout.get("model", "gpt"))  # the shape: tiny_gpt.MODELS
    tiny_gpt.init_parallel(**parallel)
    config = {**BASE_CONFIG, **(VPP_CONFIG if layout.get("vpp") else {})}
    with tempfile.TemporaryDirectory(prefix="titan-verify-") as scratch:
        env: dict[str, str] = {}
        for plugin in plugins:
            config.update(plugin_specs[plugin]["config"])
            env.update(
                {k: v.replace(SCRATCH, scratch) for k, v in plugin_specs[plugin]["env"].items()}
            )
        with _active(plugins, env) as engine:
            before = {p: _numbers(v) for p, v in report.effects().items()}
            cfg = tiny_gpt.model_config(model, **config)
            chunks = tiny_gpt.build_model(cfg, **tiny_gpt.MODELS[model].gpt_kwargs)
            losses, norms = tiny_gpt.train(chunks, cfg, STEPS, MICROBATCHES)
            after = {p: _numbers(v) for p, v in report.effects().items()}
            failed = [p.id for p in engine.patches() if p.status == "failed"] if engine else []
    changes = {
        plugin: {
            key: value - before.get(plugin, {}).get(key, 0.0)
            for key, value in counters.items()
            if value != before.get(plugin, {}).get(key, 0.0)
        }
        for plugin, counters in after.items()
    }
    return {"losses": losses, "norms": norms, "effects": changes, "failed": failed}


@contextlib.contextmanager
def _active(plugins: list[str], env: dict[str, str]) -> Iterator[Any]:
    """The plugins applied (none: megatron as installed, every patch of ours undone)."""
    if not plugins:
        yield None
        return
    from titan_plugins.testing import plugin_active

    with plugin_active(plugins, env) as engine:
        yield engine
