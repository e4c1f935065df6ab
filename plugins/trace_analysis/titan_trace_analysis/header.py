"""A rank's identity and parallel coordinates from its trace header, every field validated.

Preferred: the ``titan_parallel`` metadata our capture writes (from megatron.core.parallel_state).
Fallback: PyTorch's ``distributedInfo`` and its ``pg_config``, where process-group descriptions
name the pipeline / expert / data-parallel groups (Megatron's ``PIPELINE_MODEL_PARALLEL_GROUP``
etc., or short ``pp_group`` / ``ep_group`` / ``dp_group``); the position in a group's rank list
is the coordinate.  Kineto's ``host_name`` names the node.

Nothing from a header is used before it is checked: ranks and sizes are integers (not bools,
strings or lists) in ``[0, MAX_RANKS)``, rank < world size, group lists are lists of such
integers that contain the rank.  A bad field is reported as a problem of the file and left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .safe import safe_text

MAX_RANKS = 1_000_000
COORD_KEYS = ("pp", "pp_size", "ep", "ep_size", "ep_group", "dp", "dp_size", "tp", "tp_size")
RANK_IN_NAME = re.compile(r"rank[-_.]?(\d{1,7})(?!\d)", re.IGNORECASE)
ANY_NUMBER = re.compile(r"(\d{1,7})(?!\d)")


def valid_int(value: Any, upper: int = MAX_RANKS) -> int | None:
    """``value`` if it is an int in [0, upper), else None (bools and floats are refused)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < upper:
        return value
    return None


@dataclass
class Identity:
    """What a header says about its rank (``None``: unknown or invalid)."""

    rank: int | None = None
    world_size: int | None = None
    coords: dict[str, int] = field(default_factory=dict)
    groups: dict[str, list[int]] = field(default_factory=dict)  # role -> member ranks
    host: str | None = None
    rank_source: str = "header"
    problems: list[str] = field(default_factory=list)


ROLES = (  # Megatron's group descriptions, or the short forms other launchers use
    ("pp", re.compile(r"(pipeline_model_parallel_group|pp|pp_group)")),
    ("ep", re.compile(r"(expert_model_parallel_group|ep|ep_group)")),
    ("edp", re.compile(r"(expert_data_parallel_group|expert_dp_group|edp|edp_group)")),
    ("dp", re.compile(r"(data_parallel_group|data_parallel_group_with_cp|dp|dp_group)")),
)


def _role(desc: str) -> str | None:
    d = desc.lower()
    for role, pattern in ROLES:
        if pattern.fullmatch(d):
            return role
    return None


def _rank_list(value: Any, world: int | None) -> list[int] | None:
    if not isinstance(value, list) or not value or len(value) > (world or MAX_RANKS):
        return None
    out = [valid_int(x, world or MAX_RANKS) for x in value]
    return None if any(x is None for x in out) else out  # type: ignore[return-value]


def identity(header: dict[str, Any], file_name: str, rank_from: str = "auto") -> Identity:
    """Validated identity of one trace; ``rank_from``: auto (header, else file name), header,
    or filename (the number after ``rank`` in the name, else the file name's last number)."""
    ident = Identity()
    info = header.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    titan = header.get("titan_parallel")
    titan = titan if isinstance(titan, dict) else {}
    raw_world = titan.get("world_size", info.get("world_size"))
    raw_rank = titan.get("rank", info.get("rank"))
    if raw_world is not None:
        ident.world_size = valid_int(raw_world, MAX_RANKS + 1)
        if ident.world_size is None or ident.world_size == 0:
            ident.problems.append(
                f"invalid world_size {safe_text(repr(raw_world), 40)} in the header (need an "
                f"integer from 1 to {MAX_RANKS:,}); ignored"
            )
            ident.world_size = None
    if rank_from != "filename" and raw_rank is not None:
        ident.rank = valid_int(raw_rank, ident.world_size or MAX_RANKS)
        if ident.rank is None:
            bound = f"below world_size {ident.world_size}" if ident.world_size else "0 or more"
            ident.problems.append(
                f"invalid rank {safe_text(repr(raw_rank), 40)} in the header (need an integer "
                f"{bound}); ignored"
            )
    if ident.rank is None and rank_from != "header":
        _rank_from_name(ident, file_name, strict=rank_from == "filename")
    if ident.rank is None:
        ident.problems.append(
            "no valid rank: record with torch.distributed initialised (or the titan capture), "
            "name the file rank-<N>.json[.gz], or pass --rank-from filename"
        )
    host = header.get("host_name")
    if isinstance(host, str) and host:
        ident.host = safe_text(host, 128)
    if titan:
        for key in COORD_KEYS:
            if key in titan:
                value = valid_int(titan[key])
                if value is None:
                    ident.problems.append(f"invalid titan_parallel.{key}; ignored")
                else:
                    ident.coords[key] = value
    _groups(ident, info.get("pg_config"), fill_coords=not titan)
    _check_coords(ident)
    return ident


def _rank_from_name(ident: Identity, file_name: str, strict: bool) -> None:
    m = RANK_IN_NAME.search(file_name)
    if m is None and strict:
        numbers = ANY_NUMBER.findall(file_name)
        m = ANY_NUMBER.search(file_name) if len(numbers) == 1 else None
    if m is None:
        return
    rank = valid_int(int(m.group(1)), ident.world_size or MAX_RANKS)
    if rank is not None:
        ident.rank, ident.rank_source = rank, "file name"


def _groups(ident: Identity, pg_config: Any, fill_coords: bool) -> None:
    if pg_config is None:
        return
    if not isinstance(pg_config, list):
        ident.problems.append("distributedInfo.pg_config is not a list; ignored")
        return
    bad = 0
    for pg in pg_config[:4096]:
        if not isinstance(pg, dict):
            bad += 1
            continue
        role = _role(str(pg.get("pg_desc", ""))[:200])
        ranks = _rank_list(pg.get("ranks"), ident.world_size)
        if role is None:
            continue
        if ranks is None:
            bad += 1
            continue
        if ident.rank is None or ident.rank not in ranks or role in ident.groups:
            continue
        ident.groups[role] = ranks
        if fill_coords:
            ident.coords[role] = ranks.index(ident.rank)
            ident.coords[role + "_size"] = len(ranks)
            if role == "ep":
                ident.coords["ep_group"] = min(ranks)
    if bad:
        ident.problems.append(f"{bad} malformed pg_config entries ignored")


def _check_coords(ident: Identity) -> None:
    for key in ("pp", "ep", "dp", "tp"):
        size = ident.coords.get(key + "_size")
        if key in ident.coords and size is not None and ident.coords[key] >= size:
            ident.problems.append(f"{key}={ident.coords[key]} is not below {key}_size={size}")
            del ident.coords[key]
