"""Run by tests/test_megatron_lines.py in a fresh interpreter of the Megatron line under test:
activates every installed plugin under STRICT, imports every patch target, drives the core's
per-line hooks through the installed megatron-core's own code, and prints one JSON object.

Not a test module (no ``test_`` prefix): a fresh process keeps the patches it applies out of the
test session.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import torch

from titan_plugins.hosts.megatron.testing import cpu_harness

cpu_harness.install()

import titan_plugins  # noqa: E402
from titan_plugins import hookimpl  # noqa: E402
from titan_plugins.patching import gates  # noqa: E402

SEEN: dict[str, list[Any]] = {"configure": [], "backward": [], "optimizer": []}


class Probe:
    """Records what the core's hooks hand to a plugin."""

    @hookimpl
    def titan_configure(config: Any) -> None:
        SEEN["configure"].append(type(config).__name__)

    @hookimpl(wrapper=True)
    def titan_backward_microbatch(call: Any) -> Any:
        SEEN["backward"].append(
            sorted(call.output_tensor) if isinstance(call.output_tensor, dict) else "tensor"
        )
        return (yield)

    @hookimpl(wrapper=True)
    def titan_optimizer_step(step: Any) -> Any:
        SEEN["optimizer"].append(type(step.optimizer).__name__)
        return (yield)


def _patches(state: Any) -> list[dict[str, str]]:
    state.engine.import_pending()
    return [
        {"id": p.id, "status": p.status, "detail": p.detail, "optional": p.optional}
        for p in state.engine.patches()
    ]


def _configure() -> str:
    """Build the model config the way this line's Megatron-LM does; '' when it cannot be."""
    try:
        from megatron.training import arguments
    except ImportError as err:
        return f"no megatron.training ({err})"
    sys.argv = ["probe", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                "--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
                "--no-bias-dropout-fusion", "--vocab-size", "128"]  # fmt: skip
    args = arguments.parse_args(ignore_unknown_args=True)
    args.params_dtype = torch.float32
    try:
        from megatron.training import argument_utils
    except ImportError:
        arguments.core_transformer_config_from_args(args)
        return "arguments.core_transformer_config_from_args"
    if hasattr(argument_utils, "gpt_config_from_args"):  # 0.19's pretrain_gpt.py path
        argument_utils.gpt_config_from_args(args)
        return "argument_utils.gpt_config_from_args"
    arguments.core_transformer_config_from_args(args)
    return "arguments.core_transformer_config_from_args (re-exported)"


def _multimodule() -> str:
    from megatron.core.pipeline_parallel import schedules

    function = getattr(schedules, "backward_step_multimodule", None)
    if function is None:
        return "absent"
    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    config = SimpleNamespace(grad_scale_func=None, deallocate_pipeline_outputs=False)
    grads = function({"language": x}, loss, None, config, "language")
    return f"grad {grads['language'].tolist()}"


def _graphed_optimizer() -> str:
    try:
        from megatron.core.optimizer import optimizer_cuda_graph as graphed
    except ImportError:
        return "absent"

    class Optimizer:
        calls = 0

        def step(self) -> tuple[bool, float, int]:
            Optimizer.calls += 1
            return True, 1.0, 0

    class Graph:  # stands in for a captured torch.cuda.CUDAGraph (none on CPU)
        replays = 0

        def replay(self) -> None:
            Graph.replays += 1

    wrapper_class = graphed.OptimizerCudaGraphWrapper
    wrapper = wrapper_class(Optimizer().step, cuda_graph_warmup_steps=10**9)
    wrapper()  # before the capture: the optimizer's own step runs (nested, unhooked)
    wrapper_class.cuda_graph = Graph()
    try:
        for _ in range(3):
            wrapper()
    finally:
        wrapper_class.cuda_graph, wrapper_class.curr_iteration = None, 0
    return f"steps {Optimizer.calls}, replays {Graph.replays}"


def main() -> None:
    """Print {version, patches, configure, multimodule, graphed, seen} as JSON."""
    state = titan_plugins.apply(strict=True)
    state.manager.register(Probe, "probe")
    out: dict[str, Any] = {
        "version": gates.resolve_version("megatron-core")[0],
        "patches": _patches(state),
    }
    out["configure"] = _configure()
    out["multimodule"] = _multimodule()
    out["graphed"] = _graphed_optimizer()
    out["seen"] = SEEN
    print("PROBE " + json.dumps(out))


if __name__ == "__main__":
    main()
