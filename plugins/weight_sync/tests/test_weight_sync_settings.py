"""Every weight_sync knob is checked like every other one (a named problem; SettingError under
TITAN_PLUGINS_STRICT=1), and the plugin's switch is obeyed by the plain ``WeightSync`` path,
which runs without ``import megatron`` (so without the core's activation check)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from titan_weight_sync import settings
from titan_weight_sync.engine_api import EngineAPI
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.settings import SETTINGS, WeightSyncSettings
from titan_weight_sync.trainer_side import WeightSync

from titan_plugins.settings import SettingError, problems
from titan_plugins.transport import addresses, auth
from titan_plugins.values import shown_value

pytestmark = pytest.mark.line_independent

URL = "http://127.0.0.1:1"  # nothing listens there: a sync that got past the gate fails at hello


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in [s.name for s in SETTINGS] + ["TITAN_WEIGHT_SYNC", "TITAN_PLUGINS"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TITAN_PLUGINS_STRICT", raising=False)
    monkeypatch.setattr(addresses, "_INFINIBAND", str(tmp_path / "no-infiniband"))


def _bad_secret(tmp_path: Path, kind: str) -> str:
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir()
    elif kind == "mode644":
        auth.write_secret(str(path))
        path.chmod(0o644)
    return str(path)


@pytest.mark.parametrize(
    ("var", "value", "why"),
    [
        ("TITAN_WEIGHT_SYNC_HOST", "abc.invalid", "does not resolve ("),
        ("TITAN_WEIGHT_SYNC_HOST", "999.1.1.1", "not an IPv4 address"),
        ("TITAN_WEIGHT_SYNC_HOST", "192.0.2.1", "is not an address of this host"),
        ("TITAN_WEIGHT_SYNC_DEVICE", "abc", "no such RDMA device: 'abc' (this host has none"),
        ("TITAN_WEIGHT_SYNC_SECRET_FILE", "missing", "cannot read it (No such file"),
        ("TITAN_WEIGHT_SYNC_SECRET_FILE", "directory", "not a regular file (a directory)"),
        ("TITAN_WEIGHT_SYNC_SECRET_FILE", "fifo", "not a regular file (a FIFO)"),
        ("TITAN_WEIGHT_SYNC_SECRET_FILE", "mode644", "group or others may read it (mode 644)"),
    ],
)
def test_a_bad_value_is_a_named_problem_and_an_error_under_strict(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, var: str, value: str, why: str
) -> None:
    if var.endswith("SECRET_FILE"):
        value = _bad_secret(tmp_path, value)
    monkeypatch.setenv(var, value)
    found = problems(SETTINGS)  # what the core checks at activation
    assert len(found) == 1 and found[0].startswith(f"{var}={shown_value(value)}: {why}"), found
    assert WeightSyncSettings.read() == WeightSyncSettings()  # lenient: named, default used
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=var):
        WeightSyncSettings.read()


def test_a_nic_is_checked_against_this_host_unless_the_protocol_is_tcp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "no-infiniband" / "mlx5_0").mkdir(parents=True)
    monkeypatch.setenv("TITAN_WEIGHT_SYNC_PROTOCOL", "rdma")
    monkeypatch.setenv("TITAN_WEIGHT_SYNC_DEVICE", "mlx5_0")
    assert problems(SETTINGS) == []
    monkeypatch.setenv("TITAN_WEIGHT_SYNC_DEVICE", "mlx5_0,mlx5_3")
    assert problems(SETTINGS) == [
        "TITAN_WEIGHT_SYNC_DEVICE='mlx5_0,mlx5_3': no such RDMA device: 'mlx5_3' (this host has "
        "mlx5_0); accepted: text"
    ]
    monkeypatch.setenv("TITAN_WEIGHT_SYNC_PROTOCOL", "tcp")  # tcp uses no NIC
    assert problems(SETTINGS) == []


def test_good_values_pass(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    auth.write_secret(str(secret))
    for var, value in [
        ("TITAN_WEIGHT_SYNC_HOST", "127.0.0.1"),
        ("TITAN_WEIGHT_SYNC_HOST", "localhost"),
        ("TITAN_WEIGHT_SYNC_SECRET_FILE", str(secret)),
    ]:
        monkeypatch.setenv(var, value)
        assert problems(SETTINGS) == []


def _refusal_of_a_sync(monkeypatch: pytest.MonkeyPatch, settings_: WeightSyncSettings) -> str:
    """The WeightSyncError of a plain ``WeightSync(...).sync``; no engine may be contacted."""
    contacted: list[Any] = []
    monkeypatch.setattr(EngineAPI, "titan", lambda *a, **k: contacted.append(a))
    with pytest.raises(WeightSyncError) as caught:
        WeightSync([URL], settings_).sync({}, "v1")
    assert contacted == []
    return str(caught.value)


@pytest.mark.parametrize(("var", "value"), [("TITAN_WEIGHT_SYNC", "0"), ("TITAN_PLUGINS", "off")])
def test_switched_off_the_plain_path_does_not_sync_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, var: str, value: str
) -> None:
    secret = tmp_path / "secret"
    auth.write_secret(str(secret))
    monkeypatch.setenv(var, value)
    assert _refusal_of_a_sync(monkeypatch, WeightSyncSettings(secret_file=str(secret))) == (
        f"weight_sync: {var}=0 turns weight_sync off: this process does not sync (unset it, or "
        "set it to 1, to sync)"
    )


@pytest.mark.parametrize("value", ["abc", "-1", "9" * 400])
def test_a_switch_value_that_is_no_switch_value_is_a_named_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    secret = tmp_path / "secret"
    auth.write_secret(str(secret))
    monkeypatch.setenv("TITAN_WEIGHT_SYNC", value)
    message = _refusal_of_a_sync(monkeypatch, WeightSyncSettings(secret_file=str(secret)))
    assert message == (
        f"weight_sync: TITAN_WEIGHT_SYNC={shown_value(value)}: not a switch value; accepted: 1 or "
        "0; weight_sync does not sync until it is 1 (on) or 0 (off)"
    )
    assert len(message) < 200  # the 400 digits are shortened
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match="TITAN_WEIGHT_SYNC="):
        WeightSync([URL], WeightSyncSettings(secret_file=str(secret))).sync({}, "v1")


def test_switched_on_the_gate_lets_the_sync_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings.sync_refusal() is None
    monkeypatch.setenv("TITAN_WEIGHT_SYNC", "1")
    assert settings.sync_refusal() is None
    # past the gate: the next check is the secret's
    message = _refusal_of_a_sync(monkeypatch, WeightSyncSettings())
    assert message.startswith("weight_sync: TITAN_WEIGHT_SYNC_SECRET_FILE is not set")


def test_a_bad_secret_file_is_named_at_the_sync_not_reported_as_unset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _bad_secret(tmp_path, "mode644")
    monkeypatch.setenv("TITAN_WEIGHT_SYNC_SECRET_FILE", path)
    read = WeightSyncSettings.read()  # lenient: warns, and the default ("none") applies
    assert read.secret_file == ""
    assert _refusal_of_a_sync(monkeypatch, read) == (
        f"weight_sync: TITAN_WEIGHT_SYNC_SECRET_FILE={shown_value(path)}: group or others may "
        "read it (mode 644); chmod 600 the file; accepted: text"
    )
