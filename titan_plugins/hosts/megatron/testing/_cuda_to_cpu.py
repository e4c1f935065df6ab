"""A TorchFunctionMode that turns megatron's literal CUDA placements into CPU ones.

megatron-core 0.16.1 allocates with ``device="cuda"`` / ``torch.cuda.current_device()`` in many
places (causal mask in transformer/utils.py, token counts in schedules.py, fp32 buffers in
optimizer/optimizer.py, clip_grads.py) and asserts ``grad.type() == "torch.cuda.FloatTensor"``
(clip_grads.py). Rewriting every call site is impossible without editing megatron, so this mode
rewrites the *arguments* of every torch call instead. Test-time only (see ``cpu_harness``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, an int index, ``torch.device("cuda")``)
    to the CPU device; anything else is returned unchanged."""
    if isinstance(device, bool):  # bool is an int subclass: never a device index
        return device
    if isinstance(device, int):  # megatron passes torch.cuda.current_device() indices
        return CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


def _run_backward_unhooked(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """The body of ``torch.autograd.backward`` (torch 2.13) without its __torch_function__ check.

    Why: a mode is popped from the stack while its own handler runs, so calling ``func`` from the
    handler would run the whole backward pass (including activation recompute, which allocates with
    ``device="cuda"``) without the mode; re-pushing the mode and calling ``func`` again would
    dispatch straight back into the handler. Driving the engine directly avoids both.
    """
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    else:
        inputs = tuple(inputs)
    grads = _make_grads(
        tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False
    )
    if retain_graph is None:
        retain_graph = create_graph
    _engine_run_backward(
        tensors,
        grads,
        retain_graph,
        create_graph,
        inputs,
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _backward_call(func: Any, args: tuple, kwargs: dict) -> tuple:
    """Normalise ``Tensor.backward`` / ``torch.autograd.backward`` arguments for the engine call."""
    if func is torch.Tensor.backward:
        names = ("gradient", "retain_graph", "create_graph", "inputs")
        bound = dict(zip(names, args[1:], strict=False), **kwargs)
        return (
            args[0],
            bound.get("gradient"),
            bound.get("retain_graph"),
            bound.get("create_graph", False),
            bound.get("inputs"),
        )
    names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
    bound = dict(zip(names, args, strict=False), **kwargs)
    grad_tensors = bound.get("grad_tensors")
    if grad_tensors is None:  # deprecated alias still accepted by torch
        grad_tensors = bound.get("grad_variables")
    return (
        bound["tensors"],
        grad_tensors,
        bound.get("retain_graph"),
        bound.get("create_graph", False),
        bound.get("inputs"),
    )


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU.

    - ``device=`` keyword (str / int / torch.device) -> cpu; ``pin_memory=True`` -> False
    - ``Tensor.cuda()`` / ``Tensor.pin_memory()`` -> the tensor itself
    - ``Tensor.to("cuda" | int | torch.device("cuda"), ...)`` -> cpu
    - ``Tensor.type()`` (no arguments) -> ``"torch.cuda.<X>Tensor"`` so megatron's type-string
      asserts and branches (clip_grads.py, optimizer.py, distrib_optimizer.py) take the CUDA path
    - ``Tensor.backward`` / ``torch.autograd.backward`` run with a fresh mode pushed (see
      ``_run_backward_unhooked``) so the backward pass is rewritten too
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            with CudaToCpuMode():
                return _run_backward_unhooked(*_backward_call(func, args, kwargs))
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs an accelerator
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        if (
            func is torch.Tensor.to
            and len(args) > 1
            and not isinstance(args[1], (torch.dtype, torch.Tensor))
        ):
            args = (args[0], to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)
