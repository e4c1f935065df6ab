"""The messages and the secret: every check refuses what it must, by name (no SGLang needed)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from titan_weight_sync import digests, engine_side, layout, trainer_side, wire
from titan_weight_sync.engine_side import EngineEndpoint
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.hf_checkpoint import save_safetensors
from titan_weight_sync.settings import WeightSyncSettings
from titan_weight_sync.trainer_side import Landings, LandingWriter, WeightSync

from titan_plugins import host_memory
from titan_plugins.transport import auth

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

SECRET = bytes(range(32))
OTHER = bytes(32)


def test_a_hello_verifies_with_the_secret_only() -> None:
    nonce = auth.nonce()
    message = wire.decode(wire.hello_request(SECRET, nonce))
    assert wire.read_hello(SECRET, message) == nonce
    with pytest.raises(wire.BadMessage, match="not signed"):
        wire.read_hello(OTHER, message)
    message["trainer_nonce"] = auth.nonce()  # a changed nonce breaks the tag
    with pytest.raises(wire.BadMessage, match="not signed"):
        wire.read_hello(SECRET, message)


def test_the_engine_reply_is_checked_by_the_trainer() -> None:
    nonce = auth.nonce()
    body = {
        "session_id": "127.0.0.1:1",
        "slots": [["a", "BF16", [2, 3], 0]],
        "engine_nonce": "0" * 32,
    }
    text = wire.hello_reply(SECRET, nonce, body) + " Weight version updated to x."
    assert wire.read_hello_reply(SECRET, nonce, text) == body
    with pytest.raises(wire.BadMessage, match="not signed"):
        wire.read_hello_reply(SECRET, auth.nonce(), text)  # a reply to another hello
    with pytest.raises(wire.BadMessage, match="not ours"):
        wire.read_hello_reply(SECRET, nonce, "Success")


@pytest.mark.parametrize("algorithm", [None, "sha256"])
def test_a_trainer_refuses_an_engine_that_checks_with_another_hash(tmp_path, algorithm) -> None:
    """An engine of an older titan-weight-sync (no ``digest`` field: SHA-256) would refuse every
    commit as "differs from what the trainer wrote": the hello says why first."""
    secret_file = str(tmp_path / "secret")
    auth.write_secret(secret_file)
    secret = auth.read_secret(secret_file, "secret")
    body = {
        "session_id": "127.0.0.1:1",
        "slots": [["a", "BF16", [2, 3], 0]],
        "engine_nonce": "0" * 32,
        "landing_addr": 4096,
        "landing_bytes": 64,
        "session": True,
    }
    if algorithm is not None:
        body["digest"] = algorithm
    sync = WeightSync(["http://127.0.0.1:1"], WeightSyncSettings(secret_file=secret_file))
    api = sync.apis[0]
    ops: list[str] = []

    def titan(payload: bytes, *args, **kwargs) -> tuple[bool, str]:
        message = wire.decode(payload)
        ops.append(message["op"])
        if message["op"] == "abort":
            return True, "aborted"
        return True, wire.hello_reply(secret, message["trainer_nonce"], body)

    api.titan = titan  # type: ignore[method-assign]
    with pytest.raises(WeightSyncError, match="same titan-weight-sync version"):
        sync.open()
    assert ops == ["hello", "abort"]  # the engine's open landing region is closed again
    body["digest"] = digests.ALGORITHM
    assert [slot.name for slot in sync.open().slots] == ["a"]


def test_a_commit_is_bound_to_the_engine_nonce_and_its_digests() -> None:
    nonce = auth.nonce()
    digests = [("a", "ab" * 32), ("b", "cd" * 32)]
    message = wire.decode(wire.commit_request(SECRET, nonce, "7", digests))
    assert wire.read_commit(SECRET, nonce, message) == ("7", digests)
    with pytest.raises(wire.BadMessage, match="another exchange"):
        wire.read_commit(SECRET, auth.nonce(), message)  # replayed after a new hello
    forged = dict(message, digests=[["a", "ef" * 32], ["b", "cd" * 32]])
    with pytest.raises(wire.BadMessage, match="not signed"):
        wire.read_commit(SECRET, nonce, forged)
    with pytest.raises(wire.BadMessage, match="not signed"):
        wire.read_commit(OTHER, nonce, message)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"plain", "not a titan_weight_sync message"),
        (wire.MAGIC + b"{not json", "malformed JSON"),
        (wire.MAGIC + b'{"op": "drop"}', "unknown op"),
        (wire.MAGIC + b" " * (wire.MAX_MESSAGE_BYTES + 1), "at most"),
        ("text, not bytes", "not a titan_weight_sync message"),
    ],
)
def test_malformed_payloads_are_refused_by_name(raw: object, why: str) -> None:
    with pytest.raises(wire.BadMessage, match=why):
        wire.decode(raw)


@pytest.mark.parametrize(
    "row",
    [["x", "BF16", [2], -1], ["x", "Q4", [2], 0], ["", "BF16", [2], 0], ["x", "BF16", [1] * 9, 0]],
)
def test_a_bad_slot_row_is_refused(row: list) -> None:
    with pytest.raises(wire.BadMessage, match="slots"):
        wire.slots_field({"slots": [row]})


def test_the_secret_file_must_be_private_and_well_formed(tmp_path) -> None:
    path = tmp_path / "secret"
    with pytest.raises(auth.SecretError, match="not set"):
        auth.read_secret("", "TITAN_X")
    with pytest.raises(auth.SecretError, match="cannot read"):
        auth.read_secret(str(path), "TITAN_X")
    value = auth.write_secret(str(path))
    assert auth.read_secret(str(path), "TITAN_X") == value
    os.chmod(path, 0o644)
    with pytest.raises(auth.SecretError, match="chmod 600"):
        auth.read_secret(str(path), "TITAN_X")
    os.chmod(path, 0o600)
    path.write_text("zz" * 32)
    with pytest.raises(auth.SecretError, match="64 hex digits"):
        auth.read_secret(str(path), "TITAN_X")


def test_the_landing_table_is_the_checkpoints_and_views_round_trip(tmp_path) -> None:
    weights = {
        "b.weight": torch.randn(3, 5).to(torch.bfloat16),
        "a.weight": torch.randn(7),
        "c.bias": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }
    save_safetensors(weights, tmp_path / "model.safetensors")
    slots = layout.checkpoint_table(str(tmp_path))
    assert [(s.name, s.dtype, s.shape) for s in slots] == [
        ("a.weight", "F32", (7,)),
        ("b.weight", "BF16", (3, 5)),
        ("c.bias", "I32", (2, 3)),
    ]
    assert all(s.offset % layout.ALIGN == 0 for s in slots)
    region = torch.zeros(layout.region_bytes(slots), dtype=torch.uint8)
    for slot in slots:
        layout.view(region, slot).copy_(weights[slot.name])
    for slot in slots:
        assert torch.equal(layout.view(region, slot), weights[slot.name])


def test_a_checkpoint_header_is_bounded(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header of"):
        layout.checkpoint_table(str(tmp_path))
    with pytest.raises(ValueError, match="not a local directory"):
        layout.checkpoint_table(str(tmp_path / "absent"))
    header = json.dumps({"x": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="dtype 'Q4'"):
        layout.checkpoint_table(str(tmp_path))


@pytest.mark.parametrize(
    ("options", "why"),
    [({"pause_mode": "paused"}, "pause mode 'paused'"), ({"selector": "both"}, "selector 'both'")],
)
def test_a_session_option_sglang_lacks_is_refused_by_name(options: dict, why: str) -> None:
    with pytest.raises(WeightSyncError, match=why):
        WeightSync(["http://127.0.0.1:1"], WeightSyncSettings(protocol="tcp"), **options)


def test_a_framework_updater_keeps_its_connection_until_the_engines_or_options_change() -> None:
    from titan_weight_sync import held

    class Updater:
        pass

    updater = Updater()
    first = held.engines(updater, ["http://127.0.0.1:1"], pause_mode="retract")
    assert held.engines(updater, ["http://127.0.0.1:1"], pause_mode="retract") is first
    assert held.writer(updater) is first.writer  # rank 0 shares its connection's staging
    in_place = held.engines(updater, ["http://127.0.0.1:1"], pause_mode="in_place")
    assert in_place is not first and in_place.pause_mode == "in_place"
    other = held.engines(updater, ["http://127.0.0.1:2"], pause_mode="in_place")
    assert other is not in_place and [api.url for api in other.apis] == ["http://127.0.0.1:2"]
    held.release(updater)
    assert getattr(updater, held.SYNC) is None


@pytest.mark.parametrize(
    ("missing", "why"),
    [("blake3", "pip install blake3==1.0.11"), ("mooncake.engine", "pip install mooncake")],
)
def test_an_engine_without_a_backend_refuses_the_hello_by_name_and_holds_nothing(
    tmp_path, monkeypatch, missing: str, why: str
) -> None:
    """A titan-weight-sync installed with ``--no-deps`` (no blake3), or without its ``mooncake``
    extra: the hello fails naming the install, before the trainer writes a byte, and no landing
    memory stays reserved (the trainer then runs the framework's own path)."""
    save_safetensors({"a.weight": torch.randn(4, 4)}, tmp_path / "model.safetensors")
    secret_file = str(tmp_path / "secret")
    auth.write_secret(secret_file)
    secret = auth.read_secret(secret_file, "secret")
    endpoint = EngineEndpoint(
        str(tmp_path), WeightSyncSettings(protocol="tcp", host="127.0.0.1", secret_file=secret_file)
    )
    monkeypatch.setitem(sys.modules, missing, None)  # its import now raises ImportError
    hello = wire.hello_request(secret, auth.nonce())
    with pytest.raises(WeightSyncError, match=why):
        endpoint.handle(hello, lambda named: len(named))
    assert endpoint.nonce is None  # no exchange was opened
    assert host_memory.usage().get(engine_side.OWNER, 0) == 0
    with pytest.raises(WeightSyncError, match=why):  # the trainer's side of the same install
        if missing == "blake3":
            digests.hasher()
        else:
            LandingWriter(WeightSyncSettings(protocol="tcp", host="127.0.0.1")).write(
                Landings((), (layout.Slot("a.weight", "F32", (4, 4), 0),)),
                {"a.weight": torch.zeros(4, 4)},
            )
    assert host_memory.usage().get(trainer_side.OWNER, 0) == 0


def test_a_relative_sglang_python_is_found_from_another_directory(tmp_path, monkeypatch) -> None:
    # scripts/test.sh and docs/hosts.md name the venv from the checkout; the benchmark's test
    # runs the benchmark from benchmarks/ (CI failed on this: 'needs the SGLang venv')
    from titan_weight_sync import cpu_engine

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setattr(cpu_engine, "REPO", tmp_path)
    monkeypatch.setenv("TITAN_SGLANG_PYTHON", "venv/bin/python")
    elsewhere = tmp_path / "benchmarks"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cpu_engine.sglang_python() == str(python)
    monkeypatch.setenv("TITAN_SGLANG_PYTHON", str(python))
    assert cpu_engine.sglang_python() == str(python)
    monkeypatch.setenv("TITAN_SGLANG_PYTHON", "no/such/python")
    assert cpu_engine.sglang_python() is None
    monkeypatch.delenv("TITAN_SGLANG_PYTHON")
    assert cpu_engine.sglang_python() is None  # no .venv-sglang in this "checkout"


def test_only_sglang_0_5_15_engines_are_given_a_grpc_port(tmp_path, monkeypatch) -> None:
    # 0.5.15.post1 refuses to start without a valid one; 0.5.23 starts a gRPC server on a port
    # it is given (an extra listener, and CI lost a benchmark run to a race for that port)
    from titan_weight_sync import cpu_engine

    python = tmp_path / "venv" / "bin" / "python"
    assert cpu_engine.sglang_release(str(python)) is None
    started: list[dict] = []
    monkeypatch.setattr(cpu_engine, "sglang_python", lambda: str(python))
    monkeypatch.setattr(cpu_engine.subprocess, "Popen", lambda *a, env, **k: started.append(env))
    for release in ("0.5.23", "0.5.15.post1"):
        site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
        for old in site.glob("sglang-*.dist-info") if site.exists() else []:
            old.rmdir()
        (site / f"sglang-{release}.dist-info").mkdir(parents=True)
        assert cpu_engine.sglang_release(str(python)) == release
        cpu_engine.CPUEngine(tmp_path, tmp_path / f"{release}.log")
    assert "SGLANG_GRPC_PORT" not in started[0]
    assert 0 < int(started[1]["SGLANG_GRPC_PORT"]) < 65536
