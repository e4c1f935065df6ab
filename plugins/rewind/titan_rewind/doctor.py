"""``titan-plugins doctor`` checks of rewind: the host budget against memory and model size."""

from __future__ import annotations

import os
from typing import Any

from titan_plugins.settings import describe_bytes, format_bytes
from titan_rewind import settings as s
from titan_rewind.budget import default_budget, physical_memory

# Host bytes one snapshot keeps per parameter held by this rank: the model copy (2 in bf16,
# 4 in fp32) plus, per parameter of the optimizer's shard, the fp32 master (4, unless the model
# is fp32 already) and Adam's two fp32 moments (8). Two snapshots are held.
BYTES_PER_PARAM_BF16_ADAM = 2 + 4 + 8


def estimate_bytes(params_on_rank: int, dp_shards: int = 1) -> int:
    """Host bytes of the two snapshots of a bf16 + Adam rank holding ``params_on_rank``
    parameters whose optimizer state is sharded over ``dp_shards`` ranks."""
    per_snapshot = 2 * params_on_rank + (4 + 8) * params_on_rank // max(dp_shards, 1)
    return 2 * per_snapshot


def checks() -> list[Any]:
    """Budget vs RAM, and vs the planned snapshot size once this process trained."""
    from titan_plugins.doctor import FAIL, OK, Check
    from titan_rewind import runtime

    budget = s.MAX_HOST_BYTES.read() or default_budget()  # same rule as the store's
    ram = physical_memory()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    out = []
    if ram is not None and budget * local > ram:
        out.append(
            Check(
                "rewind.host_budget",
                FAIL,
                f"budget {format_bytes(budget)} x {local} local rank(s) exceeds RAM "
                f"{format_bytes(ram)}",
                "lower TITAN_REWIND_MAX_HOST_BYTES (per process)",
            )
        )
    else:
        out.append(
            Check(
                "rewind.host_budget",
                OK,
                f"{format_bytes(budget)} per process for two snapshots"
                + (f" (RAM {format_bytes(ram)}, {local} local rank(s))" if ram else ""),
            )
        )
    rewinder = runtime.current()
    store = rewinder._store if rewinder is not None else None
    planned = store.planned if store is not None else 0
    if planned:
        need = 2 * planned
        status = OK if need <= budget else FAIL
        out.append(
            Check(
                "rewind.model_size",
                status,
                f"two snapshots of this rank's model and optimizer need "
                f"{describe_bytes(need)} of {format_bytes(budget)}",
                "" if status == OK else "raise TITAN_REWIND_MAX_HOST_BYTES or use more DP shards",
            )
        )
    else:
        out.append(
            Check(
                "rewind.model_size",
                OK,
                "model size known once training runs; estimate two snapshots at "
                f"{2 * BYTES_PER_PARAM_BF16_ADAM} bytes per local parameter (bf16 + Adam, "
                "unsharded), 4 + 24/DP with the distributed optimizer",
                "check `titan-plugins report` after the first steps",
            )
        )
    return out
