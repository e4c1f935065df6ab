"""Run an unmodified Megatron-LM training script (``pretrain_gpt.py``) on CPU with gloo.

TEST-TIME ONLY (like :mod:`~titan_plugins.hosts.megatron.testing.cpu_harness`, which it installs)::

    torchrun --nproc-per-node 4 -m titan_plugins.testing.megatron_lm \\
        $MEGATRON_LM_DIR/pretrain_gpt.py --distributed-backend gloo --use-cpu-initialization ...

Each worker installs the CPU harness, arms these shims for ``megatron.training`` (none edits a
file; each applies right after its module executes), then runs the script as ``__main__`` with
its folder first on ``sys.path``, as ``python pretrain_gpt.py`` would. Plugins reach the worker
the way they reach a user's job: the torch.backends entry point of the installed distributions.

- ``initialize.initialize_megatron`` asserts ``torch.cuda.is_available()``: it is answered True
  (and one device) only while that function runs; faking it globally breaks ``torch._dynamo``.
- ``initialize._warmup_jit_function`` compiles megatron's fused kernels with inductor (about 25 s
  on CPU for kernels the run never uses): a no-op.
- ``megatron.legacy.fused_kernels.load`` needs nvcc: a no-op.
- ``megatron.core.transformer.custom_layers.batch_invariant_kernels`` imports ``triton``
  unconditionally (its kernels are only decorated, never launched on CPU): when triton is not
  installed, a stub is visible while that module executes, and only then.
- ``training.training_log`` is wrapped to record each iteration's losses and grad norm at full
  precision (megatron prints 7 digits), written with ``--report-dir``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import runpy
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_INITIALIZE = "megatron.training.initialize"
_FUSED_KERNELS = "megatron.legacy.fused_kernels"
_CUSTOM_LAYERS = "megatron.core.transformer.custom_layers"
_BATCH_INVARIANT = f"{_CUSTOM_LAYERS}.batch_invariant_kernels"
_TRAINING = "megatron.training.training"

# Every training_log call of this rank, at full precision: {"iteration", "losses", "grad_norm"}.
TRAINING_LOG: list[dict[str, Any]] = []


@contextlib.contextmanager
def _cuda_reported_available() -> Iterator[None]:
    import torch

    saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved


def _fix_initialize(module: types.ModuleType) -> None:
    original = module.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        with _cuda_reported_available():
            return original(*args, **kwargs)

    module.initialize_megatron = initialize_megatron  # training.py from-imports it afterwards
    module._warmup_jit_function = lambda *args, **kwargs: None


def _fix_fused_kernels(module: types.ModuleType) -> None:
    module.load = lambda *args, **kwargs: None


def _record_training_log(module: types.ModuleType) -> None:
    # megatron prints losses with 7 significant digits; tests compare runs bit for bit.
    original = module.training_log

    @functools.wraps(original)
    def training_log(loss_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        try:
            iteration, grad_norm = args[2], args[6]
            TRAINING_LOG.append(
                {
                    "iteration": int(iteration),
                    "losses": {k: _plain(v) for k, v in loss_dict.items()},
                    "grad_norm": _plain(grad_norm),
                }
            )
        except Exception as err:  # recording must never break the run it observes
            TRAINING_LOG.append({"error": f"{type(err).__name__}: {err}"})
        return original(loss_dict, *args, **kwargs)

    module.training_log = training_log


def _plain(value: Any) -> Any:
    """A tensor (a loss, or megatron's [sum, count] pair) or number as plain floats."""
    if hasattr(value, "detach"):
        return value.detach().double().tolist()
    return None if value is None else float(value)


def _stub_triton(_: types.ModuleType) -> None:
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    language = types.ModuleType("triton.language")
    language.constexpr = type("constexpr", (), {})  # type: ignore[attr-defined]
    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)  # type: ignore[attr-defined]
    triton.cdiv = lambda a, b: -(-a // b)  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    sys.modules["triton"], sys.modules["triton.language"] = triton, language

    def drop(_: types.ModuleType) -> None:
        if sys.modules.get("triton") is triton:
            del sys.modules["triton"], sys.modules["triton.language"]

    from titan_plugins.testing._post_import import when_imported

    when_imported(_BATCH_INVARIANT, drop)


def install() -> None:
    """Install the CPU harness and the megatron.training shims in this process."""
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    from titan_plugins.testing import cpu_harness
    from titan_plugins.testing._post_import import when_imported

    cpu_harness.install()
    fixes: tuple[tuple[str, Callable[[types.ModuleType], None]], ...] = (
        (_INITIALIZE, _fix_initialize),
        (_FUSED_KERNELS, _fix_fused_kernels),
        (_TRAINING, _record_training_log),
        (_CUSTOM_LAYERS, _stub_triton),  # the package runs first; the stub lives until the
    )  # kernels module has executed
    for name, fix in fixes:
        when_imported(name, fix)


def run(script: str, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``args``, as ``python script args`` would."""
    path = Path(script).resolve()
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    runpy.run_path(str(path), run_name="__main__")


def write_report(directory: str) -> Path:
    """Write this rank's plugin report (``titan_plugins.report.collect()``) and its
    :data:`TRAINING_LOG` as ``<directory>/rank<RANK>.json``; return the path."""
    from titan_plugins import report

    path = Path(directory) / f"rank{os.environ.get('RANK', '0')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**report.collect(), "training_log": TRAINING_LOG}
    path.write_text(json.dumps(_jsonable(data), indent=1, default=str))
    return path


def _jsonable(value: Any) -> Any:
    # plugin reports may key counters by tuples (e.g. (stage, chunk)): JSON wants strings
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    """``python -m titan_plugins.testing.megatron_lm [--report-dir DIR] SCRIPT [ARGS...]``.

    ``--report-dir DIR``: after the script returns, each rank writes its plugin report (patch
    statuses, each plugin's own report, where megatron came from) to ``DIR/rank<RANK>.json``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    report_dir = None
    if argv[:1] == ["--report-dir"] and len(argv) > 1:
        report_dir, argv = argv[1], argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    install()
    try:
        run(argv[0], argv[1:])
    finally:
        if report_dir is not None:
            write_report(report_dir)


if __name__ == "__main__":
    main()
