"""Turn one rank's view of a step into the global values every rank decides on.

The loss exists only on the last pipeline stage, per microbatch, not averaged over data-parallel
ranks (megatron's schedules return ``forward_data_store``: one report per microbatch there,
``[]`` elsewhere). The grad norm is already global in the optimizer's grad-stats group, but some
ranks may report None (no parameters) or 0.0 (not computed). One all-reduce (SUM, float64) of a
seven-number vector over the default process group gives every rank the same numbers:

- loss numerator and denominator summed over the last stage's ranks: the per-token loss over
  DP x CP (tensor-parallel copies count equally in both, so the ratio is unchanged);
- grad-norm sum and count over the ranks that computed one (identical values, so the mean is
  that value);
- counts of ranks whose loss / grad norm was non-finite, whose update was skipped, and of
  ranks that hold nothing to roll back to (so every rank knows whether *all* can roll back:
  a rollback on some ranks only would leave the others' weights behind and hang the job).

:func:`gather` (an object all-gather) serves the rare paths only (a rewind that escalates, a
fault that cannot be rolled back), which every rank enters in the same step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from titan_rewind.detect import Signals

_FIELDS = 8
_NUM, _DEN, _BAD_LOSS, _GN_SUM, _GN_COUNT, _BAD_GN, _SKIPPED, _NO_TARGET = range(_FIELDS)


def pick_loss(report: Any, key: str) -> Any:
    """The loss entry of one microbatch report: ``report[key]`` for a dict (``key`` empty: 'lm
    loss' if present, else the first entry), the report itself otherwise."""
    if isinstance(report, dict):
        if not report:
            return None
        if key:
            if key not in report:
                raise KeyError(
                    f"rewind: TITAN_REWIND_LOSS_KEY={key!r} is not in the loss report; it has "
                    f"{', '.join(map(str, report))}"
                )
            return report[key]
        return report["lm loss"] if "lm loss" in report else next(iter(report.values()))
    return report


def local_loss(reports: Sequence[Any], key: str) -> tuple[float, float]:
    """(numerator, denominator) of this rank's per-token loss over its microbatch reports.

    A two-element report is ``[loss_sum, num_tokens]`` (megatron's per-token form); a scalar is a
    per-microbatch mean (legacy form), counted as one.
    """
    import torch

    values = [pick_loss(report, key) for report in reports]
    values = [v for v in values if v is not None]
    if not values:
        return 0.0, 0.0
    rows = []
    for value in values:
        tensor = torch.as_tensor(value).detach().reshape(-1).double()
        if tensor.numel() >= 2:
            rows.append(tensor[:2].cpu())
        else:
            rows.append(torch.stack([tensor[0], torch.ones((), dtype=torch.float64)]).cpu())
    numerator, denominator = torch.stack(rows).sum(0).tolist()  # one device sync
    return numerator, denominator


def local_vector(
    loss: tuple[float, float] | None,
    grad_norm: Any,
    update_successful: Any,
    can_roll_back: bool = True,
) -> list[float]:
    """This rank's contribution to the all-reduce (see the module docstring)."""
    vector = [0.0] * _FIELDS
    if loss is not None and loss[1] != 0.0:
        numerator, denominator = loss
        if math.isfinite(numerator) and math.isfinite(denominator):
            vector[_NUM], vector[_DEN] = numerator, denominator
        else:
            vector[_BAD_LOSS] = 1.0
    if grad_norm is not None:
        norm = float(grad_norm)
        if not math.isfinite(norm):
            vector[_BAD_GN] = 1.0
        elif norm > 0.0:  # 0.0: megatron did not compute it (clip_grad == 0)
            vector[_GN_SUM], vector[_GN_COUNT] = norm, 1.0
    if update_successful is False:
        vector[_SKIPPED] = 1.0
    if not can_roll_back:
        vector[_NO_TARGET] = 1.0
    return vector


def reduce_signals(vector: list[float]) -> Signals:
    """All-reduce ``vector`` over the default group (when distributed) and read the Signals."""
    total = list(vector)
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device: Any = "cpu"
        if str(dist.get_backend()).lower() != "gloo":  # nccl / mccl reduce device tensors
            from titan_plugins import platform

            device = platform.current_device()
        tensor = torch.tensor(vector, dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        total = tensor.tolist()
    loss = total[_NUM] / total[_DEN] if total[_DEN] > 0 else None
    grad_norm = total[_GN_SUM] / total[_GN_COUNT] if total[_GN_COUNT] > 0 else None
    return Signals(
        loss=loss,
        grad_norm=grad_norm,
        nonfinite_loss=total[_BAD_LOSS] > 0,
        nonfinite_grad=total[_BAD_GN] > 0,
        skipped=total[_SKIPPED] > 0,
        cannot_roll_back=round(total[_NO_TARGET]),
    )


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when not distributed."""
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank. A collective: call it
    only where every rank of the default group calls it in the same step."""
    import torch

    _, size = world()
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    torch.distributed.all_gather_object(out, value)
    return out
