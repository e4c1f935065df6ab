"""Data and forward step of the tiny GPT (see ``tiny_gpt``): fixed token batches, token loss.

``fixed_batches`` depends only on ``seed``: every data-parallel rank sees the same microbatches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 128  # vocabulary size
SEQ = 16  # sequence length
MBS = 2  # micro-batch size

Batch = dict[str, torch.Tensor]


def fixed_batches(num_microbatches: int, seed: int = 0) -> list[Batch]:
    """``num_microbatches`` deterministic microbatches of random tokens (same on every rank).

    Each is a dict with ``tokens``, ``labels`` (tokens shifted by one), ``position_ids`` and
    ``loss_mask``, all of shape ``[MBS, SEQ]``.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        ids = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
        batches.append(
            {
                "tokens": ids[:, :-1].contiguous(),
                "labels": ids[:, 1:].contiguous(),
                "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, -1).contiguous(),
                "loss_mask": torch.ones(MBS, SEQ),
            }
        )
    return batches


def forward_step(
    data_iterator: Iterator[Batch], model: Any, return_schedule_plan: bool = False
) -> tuple[Any, Any]:
    """megatron ``forward_step_func``: next microbatch through ``model``; loss summed over tokens.

    The loss function returns ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``, so
    the schedules average per token. ``return_schedule_plan=True`` is the EP-overlap (combined
    1F1B) path: it returns ``model.build_schedule_plan(...)`` instead of running the forward.
    """
    batch = next(data_iterator)

    def loss_func(output_tensor: torch.Tensor) -> tuple:
        mask = batch["loss_mask"].view(-1).float()
        loss = torch.sum(output_tensor.view(-1).float() * mask)
        num_tokens = mask.sum().to(torch.int)
        report = torch.stack([loss.detach().clone(), num_tokens.float()])
        return loss, num_tokens, {"lm loss": report}

    args = (batch["tokens"], batch["position_ids"], None)
    if return_schedule_plan:
        return model.build_schedule_plan(*args, labels=batch["labels"]), loss_func
    return model(*args, labels=batch["labels"]), loss_func
