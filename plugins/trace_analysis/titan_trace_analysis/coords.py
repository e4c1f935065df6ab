"""A rank's parallel coordinates from its trace metadata.

Preferred: the ``titan_parallel`` metadata our capture writes (from megatron.core.parallel_state).
Fallback: PyTorch's ``distributedInfo.pg_config``, where process-group descriptions name the
pipeline / expert / data-parallel groups (Megatron's ``PIPELINE_MODEL_PARALLEL_GROUP`` etc., or
short ``pp_group`` / ``ep_group`` / ``dp_group``); the position in a group's rank list is the
coordinate.
"""

from __future__ import annotations

from typing import Any


def _role(desc: str) -> str | None:
    d = desc.lower()
    if "pipeline" in d or d.startswith("pp"):
        return "pp"
    if "expert_data" in d or d.startswith("expert_dp") or d.startswith("edp"):
        return "edp"
    if "expert_model" in d or d.startswith("ep"):
        return "ep"
    if "data_parallel" in d or d.startswith("dp"):
        return "dp"
    return None


def coordinates(header: dict[str, Any]) -> tuple[int | None, int | None, dict[str, int], list[str]]:
    """Return (rank, world_size, coords, problems) from a trace header.

    coords has ``pp``/``pp_size``, ``ep``/``ep_size``/``ep_group`` (lowest rank of the expert
    group), ``dp``/``dp_size`` where known (a rank without a pipeline group is stage 0, as in a
    job without pipeline parallelism); problems lists what was missing.
    """
    problems: list[str] = []
    info = header.get("distributedInfo") or {}
    titan = header.get("titan_parallel") or {}
    rank = titan.get("rank", info.get("rank"))
    world = titan.get("world_size", info.get("world_size"))
    if rank is None:
        problems.append(
            "no distributedInfo.rank: record with torch.distributed initialised (or the "
            "titan-trace-analysis capture), or name the file rank-<N>.json[.gz]"
        )
    coords: dict[str, int] = {}
    if titan:
        for key in ("pp", "pp_size", "ep", "ep_size", "ep_group", "dp", "dp_size", "tp", "tp_size"):
            if key in titan:
                coords[key] = int(titan[key])
        return rank, world, coords, problems
    for pg in info.get("pg_config") or []:
        if not isinstance(pg, dict):
            continue
        role = _role(str(pg.get("pg_desc", "")))
        ranks = pg.get("ranks")
        if role is None or not isinstance(ranks, list) or rank not in ranks:
            continue
        coords[role] = ranks.index(rank)
        coords[role + "_size"] = len(ranks)
        if role == "ep":
            coords["ep_group"] = min(ranks)
    return rank, world, coords, problems
