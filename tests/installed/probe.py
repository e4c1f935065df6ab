"""Probe run inside a fresh venv: import unmodified megatron.core and print what the registry did.

Usage: probe.py [plain|torch-first|spawn|torchrun]. Prints one JSON line per process: ``PROBE {...}``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys


def observe(where: str) -> dict:
    """Import megatron.core.parallel_state (nothing else) and report the patch and registry."""
    import megatron.core.parallel_state as ps

    state = {
        "where": where,
        "patched": bool(getattr(ps.initialize_model_parallel, "_titan_example", False)),
    }
    try:
        from titan_plugins import report

        data = report.collect()
        state["autoload"] = data["autoload"]["state"]
        state["plugins"] = {p["name"]: p["state"] for p in data["plugins"]}
        state["reasons"] = {p["name"]: p["reason"] for p in data["plugins"]}
    except ImportError:
        state["plugins"] = None
    return state


def _child(queue) -> None:
    queue.put(observe("spawn-child"))


def main(mode: str) -> None:
    if mode == "spawn":
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(queue,))
        proc.start()
        print("PROBE " + json.dumps(queue.get(timeout=240)), flush=True)
        proc.join()
        return
    if mode == "torch-first":
        import torch  # noqa: F401  # arms the lazy watcher; megatron comes later

    where = f"torchrun-rank{os.environ['RANK']}" if mode == "torchrun" else mode
    print("PROBE " + json.dumps(observe(where)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
