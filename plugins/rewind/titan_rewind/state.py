"""What a rollback must put back, collected from the live model chunks and megatron optimizer.

In a fixed order (so a snapshot's host buffers line up with the live tensors at restore):

1. every model parameter of this rank's chunks (DDP views into the param buffer; bf16 under
   mixed precision) and every non-parameter buffer (MoE ``expert_bias`` and token counters,
   rotary tables, ...);
2. per optimizer (each child of a ``ChainedOptimizer``): the parameters its torch optimizer
   steps, i.e. the fp32 main params (``fp32_from_float16_groups``, or the distributed
   optimizer's ``shard_fp32_from_float16_groups`` shards), skipped when they are model
   parameters already (``FP32Optimizer``);
3. each main param's optimizer state (Adam ``exp_avg`` / ``exp_avg_sq`` / ``step``, whatever
   the torch optimizer keeps), a ``step`` kept in a param group (TE / Apex FusedAdam), and the
   grad scaler's state.

fp32 masters are copied as they are: never rebuilt from the bf16 model weights (that would lose
the low mantissa bits; research note §2.4).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

BIG, SMALL = "big", "small"  # big: copied on the side stream; small: on the current stream


@dataclass
class Entry:
    """One live tensor and how it is copied (``kind``: big or small)."""

    tensor: torch.Tensor
    kind: str
    name: str


@dataclass
class OptimizerRecord:
    """One torch optimizer's main params and where its state lives."""

    inner: Any  # the torch optimizer (param_groups, state)
    params: list[torch.Tensor]
    scaler: Any = None  # MegatronGradScaler or None


@dataclass
class Collected:
    """The live training state of this rank, in snapshot order."""

    entries: list[Entry] = field(default_factory=list)
    optimizers: list[OptimizerRecord] = field(default_factory=list)

    def signature(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Names, shapes and dtypes: a snapshot restores only onto the same signature."""
        return [(e.name, tuple(e.tensor.shape), e.tensor.dtype) for e in self.entries]

    def nbytes(self) -> int:
        """Bytes of the model and main-param tensors (optimizer state is added at capture)."""
        return sum(e.tensor.numel() * e.tensor.element_size() for e in self.entries)


def unwrap_chunk(chunk: Any) -> Any:
    """The module inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers that own torch optimizers (children of a ChainedOptimizer, or itself)."""
    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return [leaf for child in children for leaf in leaf_optimizers(child)]
    return [optimizer]


def collect(chunks: list[Any], optimizer: Any) -> Collected:
    """Collect the live model and optimizer tensors (no copy); ``optimizer`` None: the model's
    only."""
    out = Collected()
    seen: set[int] = set()
    for index, chunk in enumerate(chunks):
        module = unwrap_chunk(chunk)
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.entries.append(Entry(param.detach(), BIG, f"chunk{index}.{name}"))
        for name, buffer in module.named_buffers():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                # Buffers (token counters) change during the next forward: copy them in order.
                out.entries.append(Entry(buffer.detach(), SMALL, f"chunk{index}.{name}"))
    model_params = set(seen)
    if optimizer is None:
        return out
    for number, leaf in enumerate(leaf_optimizers(optimizer)):
        inner = getattr(leaf, "optimizer", None)
        params = []
        if inner is not None and hasattr(inner, "param_groups"):
            for group in inner.param_groups:
                params.extend(group["params"])
        out.optimizers.append(OptimizerRecord(inner, params, getattr(leaf, "grad_scaler", None)))
        for position, param in enumerate(params):
            if id(param) not in model_params:
                out.entries.append(Entry(param.detach(), BIG, f"opt{number}.main{position}"))
    return out


@dataclass
class StateItem:
    """One key of a main param's optimizer state: a tensor (``index`` into the snapshot's
    tensors, and its device) or a plain value."""

    key: Any
    index: int | None = None
    device: torch.device | None = None
    value: Any = None


def collect_optimizer_state(
    collected: Collected,
) -> tuple[list[Entry], list[list[list[StateItem] | None]], list[list[Any]], list[Any]]:
    """Entries of every optimizer-state tensor, the per-param state plan (None: no state yet),
    the param groups' own ``step`` values, and the grad scalers' state dicts (tensors replaced by
    entry indices), numbering tensors after ``collected.entries``."""
    entries: list[Entry] = []
    plans: list[list[list[StateItem] | None]] = []
    group_steps: list[list[Any]] = []
    scalers: list[Any] = []
    base = len(collected.entries)
    for number, record in enumerate(collected.optimizers):
        per_param: list[list[StateItem] | None] = []
        state = getattr(record.inner, "state", {}) if record.inner is not None else {}
        for position, param in enumerate(record.params):
            values = state.get(param) if param in state else None
            if not values:
                per_param.append(None)
                continue
            items = []
            for key in values:
                value = values[key]
                if isinstance(value, torch.Tensor):
                    index = base + len(entries)
                    name = f"opt{number}.state{position}.{key}"
                    entries.append(Entry(value.detach(), BIG, name))
                    items.append(StateItem(key, index=index, device=value.device))
                else:
                    items.append(StateItem(key, value=copy.deepcopy(value)))
            per_param.append(items)
        plans.append(per_param)
        groups = getattr(record.inner, "param_groups", []) if record.inner is not None else []
        group_steps.append([copy.deepcopy(group.get("step")) for group in groups])
        scaler_state = None
        if record.scaler is not None:
            scaler_state = {}
            for key, value in record.scaler.state_dict().items():
                if isinstance(value, torch.Tensor):
                    scaler_state[key] = StateItem(
                        key, index=base + len(entries), device=value.device
                    )
                    entries.append(Entry(value.detach(), SMALL, f"opt{number}.scaler.{key}"))
                else:
                    scaler_state[key] = StateItem(key, value=copy.deepcopy(value))
        scalers.append(scaler_state)
    return entries, plans, group_steps, scalers
