"""Titan switches in Ray actors (how slime and miles run Megatron), on a local Ray cluster.

Documented behaviour asserted: an actor that imports torch and megatron.core gets the installed
plugins' patches through the torch.backends autoload; a switch sent through
``titan_runtime_env()`` changes what applies there; the same switch set only in the driver after
the cluster started does not reach the actor.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from titan_entrypoints.ray_env import titan_env_vars, titan_runtime_env

EXAMPLE = Path(__file__).parent / "example_plugin"


def test_runtime_env_merges_switches_and_keeps_base() -> None:
    env = {"TITAN_PLUGINS_ONLY": "a", "TORCH_DEVICE_BACKEND_AUTOLOAD": "1", "HOME": "/x"}
    base = {"pip": ["x"], "env_vars": {"TITAN_PLUGINS_ONLY": "pinned", "K": "V"}}
    out = titan_runtime_env(base, env)
    assert out == {
        "pip": ["x"],
        "env_vars": {
            "TITAN_PLUGINS_ONLY": "pinned",
            "K": "V",
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "1",
        },
    }
    assert base["env_vars"] == {"TITAN_PLUGINS_ONLY": "pinned", "K": "V"}  # not modified
    assert titan_env_vars(env) == {"TITAN_PLUGINS_ONLY": "a", "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}
    with pytest.raises(TypeError, match="env_vars"):
        titan_runtime_env({"env_vars": {"A": 1}}, env)


def _example_distribution(root: Path) -> str:
    """A dist-info that registers tests/example_plugin under the titan_plugins group."""
    info = root / "titan_example_plugin-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: titan-example-plugin\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text("[titan_plugins]\nexample = titan_example_plugin\n")
    return os.pathsep.join([str(root), str(EXAMPLE)])


class Probe:
    """Ray actor body: what a slime/miles training actor sees after importing megatron.core."""

    def state(self, late_init: bool = False) -> dict:
        """Whether the example patch is in place, then what ``titan-plugins doctor`` reports.

        ``late_init``: afterwards call the slime/miles ``--custom-megatron-init-path`` fallback.
        """
        import contextlib
        import io
        import json

        import torch  # noqa: F401  (the torch.backends autoload runs here)
        from megatron.core import parallel_state
        from titan_entrypoints.ray_env import megatron_init

        from titan_plugins.cli import main as titan_plugins

        marked = getattr(parallel_state.initialize_model_parallel, "_titan_example", False)
        late = None
        if late_init:
            megatron_init(None)
            late = getattr(parallel_state.initialize_model_parallel, "_titan_example", False)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            titan_plugins(["doctor", "--json", "--no-import"])
        checks = {c["name"]: c for c in json.loads(out.getvalue()) if c["plugin"] == "core"}
        return {
            "marked": bool(marked),
            "late": late,
            "switch": os.environ.get("TITAN_EXAMPLE"),
            "autoload": checks["autoload"],
        }


@pytest.mark.ray
def test_ray_actors_see_switches_only_through_runtime_env(tmp_path: Path, monkeypatch) -> None:
    import ray  # pinned in requirements/dev.txt: a missing ray is a broken set-up, not a skip

    monkeypatch.delenv("TITAN_EXAMPLE", raising=False)
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    job_env = {
        # the root conftest turns autoload off for pytest; actors run like production workers
        "TITAN_PLUGINS_AUTOLOAD": "1",
        "TITAN_PLUGINS_ONLY": "example",
        "PYTHONPATH": os.pathsep.join([_example_distribution(tmp_path / "dist"), *sys.path]),
        "TORCH_COMPILE_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
    }
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # AF_UNIX paths max 107 bytes
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": job_env},
        _temp_dir=temp_dir,
    )
    try:
        actor = ray.remote(num_cpus=0)(Probe)
        monkeypatch.setenv("TITAN_EXAMPLE", "0")  # driver only: the cluster already runs
        driver_only = actor.remote()
        sent = actor.options(runtime_env=titan_runtime_env()).remote()
        no_autoload = actor.options(
            runtime_env=titan_runtime_env(env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
        ).remote()
        seen = ray.get(
            [driver_only.state.remote(), sent.state.remote(), no_autoload.state.remote(True)],
            timeout=180,
        )
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    driver_only_state, sent_state, no_autoload_state = seen
    # autoload applied the installed plugin's patch inside the actor; the driver's switch is absent
    assert driver_only_state["switch"] is None and driver_only_state["marked"], driver_only_state
    assert driver_only_state["autoload"]["status"] == "ok"
    # the same switch sent through the helper's runtime_env turns the plugin off there
    assert sent_state["switch"] == "0" and not sent_state["marked"], sent_state
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0 reaches the actor too: nothing applies, doctor explains why
    assert not no_autoload_state["marked"]
    assert no_autoload_state["late"] is True  # the --custom-megatron-init-path fallback works
    assert no_autoload_state["autoload"]["status"] == "warn"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" in no_autoload_state["autoload"]["detail"]
