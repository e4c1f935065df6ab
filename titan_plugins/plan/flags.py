"""Tokenize a Megatron-LM argument list into {flag: value} with the names Megatron-LM accepts.

The accepted names and their argument counts come from ``megatron_flags.txt``, generated from
Megatron-LM core_v0.16.1's ``add_megatron_arguments`` (names only). Unknown flags are an error that
names the flag, as Megatron-LM's own parser (used by slime and miles) would reject them.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from importlib import resources


class PlanError(ValueError):
    """Bad input to ``plan``: the message names the flag and the fix."""


@lru_cache(maxsize=1)
def megatron_flags() -> dict[str, str]:
    """Map of every Megatron-LM flag (``--name``) to its nargs ("0", "1", "*", "+" or a count)."""
    try:
        text = resources.files(__package__).joinpath("megatron_flags.txt").read_text()
    except FileNotFoundError:
        raise PlanError(
            "titan_plugins/plan/megatron_flags.txt is missing: reinstall titan-plugins "
            "(it is package data of titan_plugins.plan)"
        ) from None
    table = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, nargs = line.split()
            table[name] = nargs
    return table


def _suggest(flag: str) -> str:
    close = difflib.get_close_matches(flag, list(megatron_flags()), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def parse_flags(argv: list[str]) -> dict[str, object]:
    """Parse Megatron flags into ``{"--name": value}``.

    Values: ``True`` for switches, a string for one-argument flags, a list of strings for
    multi-argument flags. ``--name=value`` is accepted. A repeated flag keeps the last value, as
    argparse does. Raises ``PlanError`` naming an unknown flag, a flag missing its value, or a stray
    positional argument.
    """
    table = megatron_flags()
    parsed: dict[str, object] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise PlanError(
                f"unexpected argument {token!r}: Megatron-LM takes only --flags here "
                f"(is a value missing its flag before it?)"
            )
        name, eq, inline = token.partition("=")
        if name not in table:
            raise PlanError(f"unknown Megatron-LM flag {name}{_suggest(name)}")
        nargs = table[name]
        i += 1
        if eq:
            parsed[name] = [inline] if nargs in ("*", "+") else inline
            continue
        values: list[str] = []
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
            if nargs == "1" or (nargs.isdigit() and len(values) == int(nargs)):
                break
        if nargs == "0":
            if values:
                raise PlanError(f"{name} is a switch and takes no value (got {values[0]!r})")
            parsed[name] = True
        elif nargs == "1":
            if not values:
                raise PlanError(f"{name} needs a value")
            parsed[name] = values[0]
        elif nargs == "+" and not values:
            raise PlanError(f"{name} needs at least one value")
        elif nargs.isdigit() and len(values) != int(nargs):
            raise PlanError(f"{name} needs {nargs} values")
        else:
            parsed[name] = values
    return parsed
