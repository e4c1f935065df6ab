"""The titan-plugins CLI tells the truth: list, report, doctor and env."""

from __future__ import annotations

import json
import os

import pytest

from titan_plugins import activation, cli
from titan_plugins.testing import fake_entry_point


@pytest.fixture
def only_example(monkeypatch):
    """Discovery sees just the example plugin (from tests/example_plugin)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "example_plugin"))
    monkeypatch.setattr(
        "titan_plugins.manager.discover",
        lambda: [
            fake_entry_point("example", "titan_example_plugin", "titan-example-plugin", "0.1.0")
        ],
    )
    monkeypatch.setattr(activation, "_CURRENT", None)
    for var in ("TITAN_PLUGINS", "TITAN_EXAMPLE", "TITAN_PLUGINS_DISABLE", "TITAN_PLUGINS_STRICT"):
        monkeypatch.delenv(var, raising=False)
    yield
    activation.undo()


def test_list_shows_plugin_hooks_and_patch_status(only_example, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "example  [titan-example-plugin 0.1.0]  enabled" in out
    assert "titan_register_patches" in out
    assert "patch example.mark_initialize_model_parallel -> megatron.core.parallel_state" in out


def test_list_says_why_disabled(only_example, capsys, monkeypatch):
    monkeypatch.setenv("TITAN_EXAMPLE", "0")
    cli.main(["list"])
    assert "disabled (TITAN_EXAMPLE=0)" in capsys.readouterr().out


def test_report_json_with_imported_targets(only_example, capsys):
    assert cli.main(["report", "--import-targets"]) == 0
    data = json.loads(capsys.readouterr().out)
    (plugin,) = data["plugins"]
    assert plugin["patches"][0]["status"] == "applied"
    assert plugin["report"]["greeting"] == "hello"


def test_doctor_lists_core_and_plugin_checks(only_example, capsys):
    assert cli.main(["doctor", "--json"]) == 0
    checks = json.loads(capsys.readouterr().out)
    names = {(c["plugin"], c["name"]): c["status"] for c in checks}
    assert names[("core", "torch")] == "ok" and names[("example", "example")] == "ok"
    assert ("core", "megatron-core") in names and ("core", "platform") in names


def test_doctor_explains_disabled_autoload(only_example, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    cli.main(["doctor", "--no-import"])
    out = capsys.readouterr().out
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD='0'" in out and "titan-run" in out


def test_env_documents_switches_and_flags_typos(only_example, capsys, monkeypatch):
    monkeypatch.setenv("TITAN_EXAMPL_GREETING", "hi")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "TITAN_PLUGINS_STRICT" in out and "TITAN_EXAMPLE_GREETING" in out
    assert "TITAN_EXAMPL_GREETING is set but no installed plugin declares it" in out


@pytest.mark.parametrize("command", ["list", "report", "doctor", "env"])
@pytest.mark.parametrize(
    ("var", "value"),
    [("TITAN_PLUGINS", "maybe"), ("TITAN_PLUGINS_ONLY", "nonexistent"), ("TITAN_EXAMPLE", "nah")],
)
def test_strict_commands_show_the_diagnosis_and_fail(
    only_example, capsys, monkeypatch, command, var, value
):
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    monkeypatch.setenv(var, value)
    assert cli.main([command] + (["--no-import"] if command == "doctor" else [])) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert var in captured.out + captured.err and value in captured.out + captured.err


def test_without_strict_the_same_value_only_warns(only_example, capsys, monkeypatch):
    monkeypatch.setenv("TITAN_EXAMPLE", "nah")
    assert cli.main(["list"]) == 0
    capsys.readouterr()
    assert cli.main(["doctor", "--json", "--no-import"]) == 1  # doctor calls it a failure
    checks = json.loads(capsys.readouterr().out)
    (bad,) = [c for c in checks if c["name"] == "setting"]
    assert bad["status"] == "fail" and "TITAN_EXAMPLE='nah'" in bad["detail"]


def test_malformed_strict_value_counts_as_strict(only_example, capsys, monkeypatch):
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "maybe")
    assert cli.main(["list"]) == 1
    err = capsys.readouterr().err
    assert "error: TITAN_PLUGINS_STRICT='maybe' is not a boolean (accepted: " in err
    # named as what it is, never as if STRICT=1 had been set
    assert "error: an unreadable TITAN_PLUGINS_STRICT counts as on, and the problems above" in err
    assert "TITAN_PLUGINS_STRICT=1" not in err


def test_doctor_fails_on_a_misspelled_variable_naming_the_declared_one(
    only_example, capsys, monkeypatch
):
    monkeypatch.setenv("TITAN_EXAMPL_GREETING", "hi")
    assert cli.main(["doctor", "--json", "--no-import"]) == 1
    checks = json.loads(capsys.readouterr().out)
    assert [c["detail"] for c in checks if c["name"] == "setting"] == [
        "TITAN_EXAMPL_GREETING is set but no installed plugin declares it, nor the core: "
        "did you mean TITAN_EXAMPLE_GREETING? (or unset it)"
    ]


@pytest.fixture
def installed_plugins(monkeypatch):
    """Discovery sees the installed plugins; no TITAN_* variable of the caller leaks in."""
    from titan_plugins import settings

    for var in [v for v in os.environ if v.startswith("TITAN_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr(settings, "_WARNED", set())
    monkeypatch.setattr(activation, "_CURRENT", None)
    yield
    activation.undo()


def _typos(out: str) -> list[str]:
    return [line for line in out.splitlines() if "no installed plugin declares it" in line]


@pytest.mark.parametrize(
    "env",
    [
        {"TITAN_REWIND_MAX_HOST_BYTES": "9" * 401},  # a bad value: shown as its problem
        {"TITAN_PLUGINS_ONLY": "act_offload", "TITAN_REWIND_INTERVAL": "5"},  # plugin off
        {"TITAN_REWIND": "0", "TITAN_REWIND_MAX_HOST_BYTES": "lots"},  # off, and a bad value
    ],
    ids=["bad-value", "plugin-off", "off-and-bad"],
)
def test_env_never_calls_a_declared_knob_a_typo(installed_plugins, capsys, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TITAN_REWND_INTERVAL", "5")  # a real typo, still flagged
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert _typos(out) == [
        "warning: TITAN_REWND_INTERVAL is set but no installed plugin declares it, nor the core: "
        "did you mean TITAN_REWIND_INTERVAL? (or unset it)"
    ]
    assert "TITAN_REWIND_INTERVAL=" in out and "TITAN_ACT_OFFLOAD_MIN_BYTES=" in out
    if "TITAN_REWIND_MAX_HOST_BYTES" in env:
        assert "    error: TITAN_REWIND_MAX_HOST_BYTES=" in out
        assert "9" * 100 not in out  # the value is shortened, also in the listing


def test_env_lists_every_plugins_knobs_even_when_activation_fails(
    installed_plugins, capsys, monkeypatch
):
    def broken(self):
        raise RuntimeError("something else went wrong")

    monkeypatch.setattr(activation.Activation, "start", broken)
    monkeypatch.setenv("TITAN_PP_RDMA_INLINE_BYTES", "64K")
    cli.main(["env"])
    out = capsys.readouterr().out
    assert _typos(out) == [] and "TITAN_PP_RDMA_INLINE_BYTES='64K'" in out
