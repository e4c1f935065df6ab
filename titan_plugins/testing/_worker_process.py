"""The worker side of ``GlooWorkerPool``: start-up, task loop, function lookup by file path.

Runs in a spawned child, or in a child forked from the fork server of a preloaded pool. The
parent has already put the worker environment (autoload off, one thread, torch.compile off) into
``os.environ`` before spawning, because ``import torch`` (which fires the plugin autoload) happens
while the child unpickles this module, before any code here; the fork server was started with the
same environment and imported torch under it (``_worker_preload``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import importlib.util
import os
import pickle
import sys
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

FunctionRef = tuple[str, str, str | None]  # (module name, qualname, source file)

# Task modules loaded by file path (test files pytest imported with --import-mode=importlib, whose
# module names are not importable here), keyed by absolute path.
_LOADED_BY_PATH: dict[str, ModuleType] = {}


def _same_file(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _load_by_path(path: str) -> ModuleType:
    path = os.path.abspath(path)
    module = _LOADED_BY_PATH.get(path)
    if module is not None:
        return module
    stem = os.path.splitext(os.path.basename(path))[0]
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    name = f"_titan_task_{stem}_{digest}"  # unique: never shadows a real module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load task module from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses/pickle look the module up while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _LOADED_BY_PATH[path] = module
    return module


def _module_for(module_name: str, path: str | None) -> ModuleType:
    """The module that defines the task: by name when that name resolves to the same file (so
    package modules keep one copy and their globals), else by file path."""
    if path is None:
        return importlib.import_module(module_name)
    if module_name != "__main__":
        loaded = sys.modules.get(module_name)
        if loaded is not None and _same_file(getattr(loaded, "__file__", None), path):
            return loaded
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and _same_file(spec.origin, path):
            return importlib.import_module(module_name)
    return _load_by_path(path)


def resolve(ref: FunctionRef) -> Any:
    """The function named by ``ref`` (module name, qualname, source file)."""
    module_name, qualname, path = ref
    target: Any = _module_for(module_name, path)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _error_message(exc: BaseException) -> tuple:
    try:
        exc_bytes = pickle.dumps(exc)
        pickle.loads(exc_bytes)  # must round-trip, else the parent gets a plain WorkerError
    except Exception:
        exc_bytes = None
    summary = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return ("error", exc_bytes, traceback.format_exc(), summary)


def _start(rank: int, world_size: int, port: int, init_timeout_s: float) -> None:
    import torch

    torch.set_num_threads(1)
    # megatron warns about absent apex/TE etc. on every build; keep worker output readable.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    # torch 2.13 deprecates all_gather_into_tensor, which megatron calls every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()
    import megatron.core  # noqa: F401  (the ~7 s import every task would otherwise pay)
    import torch.distributed as dist

    from titan_plugins.testing import gloo_device

    # the worker keeps every layout's groups: one I/O thread for all, not one each (gloo_device)
    gloo_device.share_one_device()

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=init_timeout_s)
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=init_timeout_s),
    )


def worker_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    init_timeout_s: float,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of a pool worker: start up, then run tasks until told to close (or EOF).

    ``env``: the parent's environment at the pool's start, set here for a worker forked by the
    fork server (which would otherwise keep the server's)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        _start(rank, world_size, port, init_timeout_s)
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(_error_message(exc)))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            request = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # parent gone: exit quietly
            break
        if request[0] == "close":
            break
        _, ref, args, kwargs = request
        try:
            result = resolve(ref)(*args, **kwargs)
            reply = pickle.dumps(("ok", result))
        except BaseException as exc:
            reply = pickle.dumps(_error_message(exc))
        finally:
            gc.collect()  # drop the task's models before the next task builds its own
        conn.send_bytes(reply)
    _shutdown()


def _shutdown() -> None:
    """Leave at once: destroy the gloo group, flush output, ``os._exit``.

    Why not a normal interpreter exit: finalising torch + megatron at exit takes seconds (more on
    a loaded machine), multiplied by every pool in the session, and the parent waits for it.
    """
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
