"""Carry the driver's Titan switches to Ray actors (slime / miles training actors included).

Ray workers get the environment of the raylet that started them (fixed when ``ray start`` ran),
plus the job's and the actor's ``runtime_env["env_vars"]``; a variable set only in the driver
(``os.environ`` or the shell that runs the driver) does not reach them. ``titan_runtime_env()``
copies the driver's ``TITAN_*`` switches and ``TORCH_DEVICE_BACKEND_AUTOLOAD`` into a
``runtime_env`` so they do::

    from titan_entrypoints.ray_env import titan_runtime_env
    Actor = ray.remote(runtime_env=titan_runtime_env())(Actor)        # per actor
    ray.init(runtime_env=titan_runtime_env({"pip": [...]}))            # per job

For slime / miles (which build the actors' runtime_env themselves) pass the same mapping as
``--train-env-vars "$(python -m titan_entrypoints.ray_env --json-env-vars)"``; for
``ray job submit`` use ``--runtime-env-json "$(python -m titan_entrypoints.ray_env)"``.
See docs/hosts.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

# Variables that decide what the plugins do in a process (read there, at activation time).
EXTRA_VARS = ("TORCH_DEVICE_BACKEND_AUTOLOAD",)
PREFIX = "TITAN_"


def titan_env_vars(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``TITAN_*`` switches and ``TORCH_DEVICE_BACKEND_AUTOLOAD`` of ``env`` (default: os.environ)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(PREFIX) or k in EXTRA_VARS}


def titan_runtime_env(
    base: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``base`` (a Ray runtime_env, not modified) with the Titan switches merged into env_vars.

    Values already in ``base["env_vars"]`` win over the driver's, so a job can pin a switch
    explicitly. Raises ``TypeError`` when ``base["env_vars"]`` is not a mapping of strings.
    """
    out: dict[str, Any] = copy.deepcopy(dict(base or {}))
    current = out.get("env_vars") or {}
    if not isinstance(current, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in current.items()
    ):
        raise TypeError("runtime_env['env_vars'] must map str to str (Ray's own rule)")
    out["env_vars"] = {**titan_env_vars(env), **current}
    return out


def megatron_init(args: Any = None) -> None:
    """Late explicit activation for slime / miles: ``--custom-megatron-init-path
    titan_entrypoints.ray_env.megatron_init``.

    For actors where the automatic channel is off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). The hosts
    call it after ``mpu.initialize_model_parallel``, so it is late: modules already imported are
    patched at once, but objects built before it (and names other modules copied) keep the old
    code. ``args`` (the host's Megatron namespace) is not used.
    """
    import titan_plugins

    titan_plugins.apply()


def main(argv: list[str] | None = None) -> int:
    """Print the runtime_env JSON (or only its env_vars, for slime/miles ``--train-env-vars``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json-env-vars",
        action="store_true",
        help="print only the env_vars mapping (slime/miles --train-env-vars)",
    )
    parser.add_argument("--base", default="{}", help="runtime_env JSON to merge into")
    args = parser.parse_args(argv)
    runtime_env = titan_runtime_env(json.loads(args.base))
    print(json.dumps(runtime_env["env_vars"] if args.json_env_vars else runtime_env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
