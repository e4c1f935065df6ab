"""The SGLang host room without SGLang (the real engines run in plugins/weight_sync's SGLang
tests): its gates, its entry point's activation, STRICT's stop, and what the reports say."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from titan_plugins.hosts import sglang
from titan_plugins.patching import gates


def test_release_gates_name_the_releases_and_their_post_releases() -> None:
    assert sglang.sglang_releases("0.5.23") == "sglang>=0.5.23,<0.5.24"
    assert sglang.SUPPORTED_SGLANG == "sglang>=0.5.15,<0.5.24"
    assert gates.judge_version("sglang>=0.5.15,<0.5.16", "0.5.15.post1").reason is None
    assert "outside" in gates.judge_version(sglang.sglang_releases("0.5.23"), "0.5.15.post1").reason
    with pytest.raises(ValueError, match="known releases"):
        sglang.sglang_releases("0.4.0")
    assert sglang.sglang_releases("0.5.23") in sglang.LINE_GATES


def _register(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The entry point as SGLang's loader calls it, in a fresh interpreter."""
    code = (
        "from titan_entrypoints import sglang_plugins\nsglang_plugins.register()\nprint('ALIVE')\n"
    )
    full = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**full, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_entry_point_activates_and_names_the_process() -> None:
    done = _register({})
    assert done.returncode == 0, done.stderr
    assert "ALIVE" in done.stdout
    line = next(x for x in done.stderr.splitlines() if x.startswith("[titan_plugins] sglang"))
    assert "activated via sglang.srt.plugins" in line
    assert "weight_sync (enabled)" in line


def test_strict_stops_the_sglang_process_with_the_problem() -> None:
    bad = {"TITAN_PLUGINS_STRICT": "1", "TITAN_WEIGHT_SYNC_PROTOCOL": "udp"}
    done = _register(bad)
    assert done.returncode == 1 and "ALIVE" not in done.stdout
    assert "TITAN_WEIGHT_SYNC_PROTOCOL" in done.stderr and "udp" in done.stderr
    lenient = _register({"TITAN_WEIGHT_SYNC_PROTOCOL": "udp"})  # warned, the default applies
    assert lenient.returncode == 0 and "ALIVE" in lenient.stdout
    assert "TITAN_WEIGHT_SYNC_PROTOCOL" in lenient.stderr


def test_titan_plugins_off_is_honoured_in_sglang_processes() -> None:
    done = _register({"TITAN_PLUGINS": "0"})
    assert done.returncode == 0
    assert "TITAN_PLUGINS=0" in done.stderr and "plugins: none" in done.stderr


def test_the_list_names_the_installed_sglang() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli", "list"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    described = sglang.describe()
    assert f"  sglang: {described['summary']}" in done.stdout
    assert described["process"]["role"] is None  # not an SGLang process


@pytest.mark.skipif(
    sglang.describe()["version"] is not None,
    reason="SGLang is installed in this venv (the Megatron lines' venvs, where this runs, have none)",
)
def test_a_patch_for_an_absent_host_neither_fails_strict_nor_marks_the_plugin_inactive() -> None:
    # a trainer's venv has no SGLang: weight_sync's engine-side patch is skipped there, and the
    # plugin (whose trainer side is an API) is still listed as enabled
    done = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli", "list", "--import-targets"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TITAN_PLUGINS_STRICT": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "- weight_sync  [titan-weight-sync" in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith("- weight_sync"))
    assert line.endswith("enabled"), line
    assert "weight_sync.engine_endpoint" in done.stdout and ": skipped" in done.stdout
