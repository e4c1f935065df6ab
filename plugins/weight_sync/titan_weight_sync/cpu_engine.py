"""Start and drive a CPU SGLang engine (``sglang.launch_server``) in the SGLang venv, for the
tests, the benchmark and a first try on a laptop: the arguments and environment a CPU engine
needs (shared/research/rl_rollout.md §1.3), its HTTP calls, and its log.

The engine runs in its own interpreter (``TITAN_SGLANG_PYTHON``, default ``.venv-sglang`` of the
repository, made by ``scripts/sglang_env.sh``); the trainer side stays in the Megatron venv.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_plugins.transport.mooncake import free_port
from titan_plugins.values import shown_value
from titan_weight_sync.engine_api import EngineAPI
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.settings import SGLANG_PYTHON

REPO = Path(__file__).resolve().parents[3]
_SGLANG_ENV_CHOICES = ("SGLANG_RELEASE", "SGLANG_VENV", "SGLANG_DEPS_ONLY")
CPU_ARGS = (
    "--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch", "--disable-cuda-graph", "--max-total-tokens", "2048",
    "--mem-fraction-static", "0.05", "--skip-tokenizer-init", "--random-seed", "0",
    "--log-level", "info", "--sleep-on-idle",
)  # fmt: skip


def sglang_python() -> str | None:
    """The interpreter of the SGLang venv as an absolute path, or None when there is none.

    A relative ``TITAN_SGLANG_PYTHON`` is looked up in the working directory, then in the
    checkout: the docs and ``scripts/test.sh`` name ``.venv-sglang.../bin/python`` from the
    checkout, and the benchmark runs from ``benchmarks/``.
    """
    named = SGLANG_PYTHON.read()
    if not named:
        candidates = [REPO / ".venv-sglang" / "bin" / "python"]
    elif os.path.isabs(named):
        candidates = [Path(named)]
    else:
        candidates = [Path.cwd() / named, REPO / named]
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return str(candidate.absolute())
    return None


def prepare_sglang_python(
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    say: Callable[[str], None] = print,
) -> str | None:
    """The SGLang venv's interpreter; where the checkout's default venv is missing, made first
    with ``./scripts/sglang_env.sh`` (saying so: it takes minutes, once). None after saying in
    one line what to do: ``TITAN_SGLANG_PYTHON`` names no interpreter (the user's choice is not
    overridden), there is no checkout to make one in, or the script failed.

    :param run: runs the script (``subprocess.run``'s signature; tests pass a fake).
    :param say: prints a line for the user.
    """
    python = sglang_python()
    if python is not None:
        return python
    script = REPO / "scripts" / "sglang_env.sh"
    command = f"cd {REPO} && ./scripts/sglang_env.sh"
    named = SGLANG_PYTHON.read()
    if named:
        say(
            f"{SGLANG_PYTHON.name}={shown_value(named)} is not an interpreter here: fix it, or "
            f"unset it and run {command}"
        )
        return None
    if not script.is_file():  # an installed plugin, outside the checkout
        say(f"no SGLang venv: set {SGLANG_PYTHON.name} to the python of an SGLang venv")
        return None
    say(f"no SGLang venv yet: preparing {REPO / '.venv-sglang'} with {command} (minutes, once)")
    # the default release's venv, the one sglang_python() looks for (a shell's SGLANG_RELEASE
    # or SGLANG_VENV would make another)
    env = {k: v for k, v in os.environ.items() if k not in _SGLANG_ENV_CHOICES}
    done = run([str(script)], cwd=str(REPO), env=env, check=False)
    python = sglang_python() if done.returncode == 0 else None
    if python is None:
        say(f"preparing the SGLang venv failed (exit {done.returncode}); run {command}")
    return python


def sglang_release(python: str) -> str | None:
    """The SGLang release installed in the venv of ``python`` (from its dist-info), or None."""
    venv = Path(python).parent.parent
    found = sorted(venv.glob("lib/python3.*/site-packages/sglang-*.dist-info"))
    return found[0].name[len("sglang-") : -len(".dist-info")] if found else None


class CPUEngine:
    """One ``sglang.launch_server`` process serving ``model_dir`` on 127.0.0.1.

    :param env: extra environment (the weight_sync knobs: ``TITAN_WEIGHT_SYNC_SECRET_FILE``...).
    :param log: where its output goes.
    :param args: more server arguments; they win over the CPU defaults (e.g.
        ``("--mem-fraction-static", "0.2")`` for a model of a GB or more).
    """

    def __init__(
        self,
        model_dir: str | Path,
        log: str | Path,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ):
        python = sglang_python()
        if python is None:
            raise WeightSyncError(
                "no SGLang venv: run ./scripts/sglang_env.sh (or set TITAN_SGLANG_PYTHON)"
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        grpc = {}
        if sglang_release(python) == "0.5.15.post1":
            # it checks a gRPC port even with gRPC off (its default, --port + 10000, overflows
            # for an ephemeral --port); 0.5.23 would start a gRPC server on the port it is given
            grpc = {"SGLANG_GRPC_PORT": str(free_port())}
        full_env = {
            **os.environ,
            "SGLANG_USE_CPU_ENGINE": "1",
            "TITAN_WEIGHT_SYNC_PROTOCOL": "tcp",
            "OMP_NUM_THREADS": "1",
            **grpc,
            **(env or {}),
        }
        full_env.pop("TITAN_PLUGINS_AUTOLOAD", None)  # the engine loads plugins as users' do
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [python, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                 "--host", "127.0.0.1", "--port", str(self.port), *CPU_ARGS, *args],
                stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
            )  # fmt: skip
        self.api = EngineAPI(self.url, timeout_s=120.0)
        self.client = EngineClient(self.url)

    def wait_ready(self, timeout_s: float = 300.0) -> CPUEngine:
        """Block until the engine answers; raises with its log's tail when it died or hung."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise WeightSyncError(
                    f"the engine exited ({self.process.returncode}):\n{self.tail()}"
                )
            try:
                if "weight_version" in self.api.call("/model_info", get=True):
                    return self
            except WeightSyncError:
                pass
            time.sleep(1.0)
        raise WeightSyncError(f"the engine did not start in {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The last lines of its log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the engine and its subprocesses."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 9)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)


class EngineClient:
    """What tests and the benchmark ask an engine over HTTP (any process may hold one)."""

    def __init__(self, url: str, timeout_s: float = 120.0) -> None:
        self.url = url
        self.api = EngineAPI(url, timeout_s)

    def generate(self, prompts: list[list[int]], new_tokens: int = 8) -> list[dict[str, Any]]:
        """Greedy generation with logprobs: ``[{"tokens": [...], "logprobs": [...]}]``."""
        answer = self.api.call(
            "/generate",
            {
                "input_ids": prompts,
                "sampling_params": {
                    "max_new_tokens": new_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                "return_logprob": True,
            },
        )
        rows = answer.get("result", answer)
        if not isinstance(rows, list):
            raise WeightSyncError(f"generate failed: {answer}")
        return [
            {
                "tokens": row["output_ids"],
                "logprobs": [entry[0] for entry in row["meta_info"]["output_token_logprobs"]],
            }
            for row in rows
        ]

    def weight_version(self) -> str:
        """The engine's weight version now."""
        return str(self.api.call("/model_info", get=True).get("weight_version"))

    def sglang_version(self) -> str:
        """The engine's SGLang release (``/server_info``)."""
        return str(self.api.call("/server_info", get=True).get("version"))

    def has_session(self) -> bool:
        """Whether the engine's SGLang has the weight-update session (0.5.23; not
        0.5.15.post1)."""
        return not self.sglang_version().startswith("0.5.15")

    def load_from_disk(self, model_dir: str | Path, version: str) -> None:
        """SGLang's own ``update_weights_from_disk``, inside its session where it has one (the
        reference path)."""
        session = self.has_session()
        if session:
            self.api.require("/begin_weight_update")
        self.api.require(
            "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": version}
        )
        if session:
            self.api.require("/end_weight_update")
