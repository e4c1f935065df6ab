"""Unit tests of the pieces that need no second process: wire format, knobs, fallback ops."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from titan_pp_rdma import mooncake_engine, report, torch_p2p
from titan_pp_rdma.settings import SETTINGS, PPRdmaSettings
from titan_pp_rdma.wire import decode, describe_key, encode, key_nbytes, parse_key, tensor_key

from titan_plugins.settings import SettingError, problems

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


@pytest.mark.parametrize(
    ("shape", "dtype", "nbytes"),
    [((16, 2, 64), torch.float32, 8192), ((3,), torch.bfloat16, 6), ((2, 5), torch.int64, 80)],
)
def test_tensor_key_round_trip(shape: tuple, dtype: torch.dtype, nbytes: int) -> None:
    key = tensor_key(shape, dtype)
    assert parse_key(key) == (shape, dtype)
    assert key_nbytes(key) == nbytes
    assert describe_key(key) == f"shape {shape} dtype {dtype}"


def test_messages_round_trip_and_error_text_stays_whole() -> None:
    assert decode(encode("S", "f", "float32:4x2", 7, 1)) == ["S", "f", "float32:4x2", "7", "1"]
    assert decode(encode("E", "a|b: c")) == ["E", "a|b: c"]


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setenv("TITAN_PP_RDMA_PROTOCOL", "tcp")
    monkeypatch.setenv("TITAN_PP_RDMA_TIMEOUT_S", "2.5")
    monkeypatch.setenv("TITAN_PP_RDMA_METADATA", "http://127.0.0.1:8080/metadata")
    monkeypatch.setenv("TITAN_PP_RDMA_INLINE_BYTES", "16K")
    monkeypatch.setenv("TITAN_PP_RDMA_SPIN_US", "0")
    monkeypatch.setenv("TITAN_PP_RDMA_BUFFERS", "zero")  # malformed: warns, keeps the default
    s = PPRdmaSettings.from_env()
    assert "TITAN_PP_RDMA_BUFFERS" in caplog.text and "zero" in caplog.text
    assert (s.protocol, s.timeout_s, s.buffers, s.inline_bytes) == ("tcp", 2.5, "auto", 16384)
    assert s.spin_us == 0.0
    assert s.metadata == "http://127.0.0.1:8080/metadata"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TITAN_PP_RDMA_TIMEOUT_S", "nan"),  # issue 14: nan / inf / 1e15 were accepted
        ("TITAN_PP_RDMA_TIMEOUT_S", "inf"),
        ("TITAN_PP_RDMA_TIMEOUT_S", "1e15"),
        ("TITAN_PP_RDMA_TIMEOUT_S", "0.01"),
        ("TITAN_PP_RDMA_METADATA", "bogus"),
        ("TITAN_PP_RDMA_METADATA", "etcd://host-without-port"),
        ("TITAN_PP_RDMA_HOST", "0.0.0.0"),  # would listen on every interface
        ("TITAN_PP_RDMA_HOST", "::"),
        ("TITAN_PP_RDMA_HOST", "bad host!"),
        ("TITAN_PP_RDMA_DEVICE", "mlx5_0;reboot"),
        ("TITAN_PP_RDMA_INLINE_BYTES", "2G"),
        ("TITAN_PP_RDMA_BUFFERS", "zero"),
        ("TITAN_PP_RDMA_SPIN_US", "-1"),
        ("TITAN_PP_RDMA_SPIN_US", "1e6"),  # a second of spinning per wait: a burnt core
        ("TITAN_PP_RDMA_SPIN_US", "fast"),
    ],
)
def test_bad_knob_values_are_reported_and_refused_under_strict(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    messages = problems(SETTINGS)
    assert len(messages) == 1 and var in messages[0] and repr(value) in messages[0], messages
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "0")
    assert PPRdmaSettings.from_env() == PPRdmaSettings()  # lenient: warns, uses the default
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(SettingError, match=var):
        PPRdmaSettings.from_env()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TITAN_PP_RDMA_METADATA", "P2PHANDSHAKE"),
        ("TITAN_PP_RDMA_METADATA", "redis://10.0.0.1:6379"),
        ("TITAN_PP_RDMA_HOST", "10.1.2.3"),
        ("TITAN_PP_RDMA_HOST", "node-17.cluster.local"),
        ("TITAN_PP_RDMA_HOST", "fe80::1"),
        ("TITAN_PP_RDMA_DEVICE", "mlx5_0,mlx5_1"),
        ("TITAN_PP_RDMA_TIMEOUT_S", "86400"),
    ],
)
def test_good_knob_values_pass(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    assert problems(SETTINGS) == []


def test_protocol_autodetect(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_plugins.transport import mooncake

    monkeypatch.setattr(mooncake, "rdma_nics", lambda: ["mlx5_0"])
    assert mooncake_engine.resolve_protocol("auto") == "rdma"
    monkeypatch.setattr(mooncake, "rdma_nics", lambda: [])
    assert mooncake_engine.resolve_protocol("auto") == "tcp"
    assert mooncake_engine.resolve_protocol("rdma") == "rdma"


def test_host_defaults_to_loopback_for_a_local_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert mooncake_engine.resolve_host("") == "127.0.0.1"
    assert mooncake_engine.resolve_host("10.0.0.7") == "10.0.0.7"


def test_alias_keeps_storage_that_deallocate_output_tensor_replaces() -> None:
    out = torch.arange(6.0)
    held = torch_p2p.alias(out)
    out.data = torch.empty((1,))  # what schedules.deallocate_output_tensor does
    assert held.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_batched_ops_post_sends_next_prev_then_recvs_prev_next(monkeypatch: Any) -> None:
    posted: list[tuple[str, int]] = []

    class FakeOp:
        def __init__(self, fn: Any, tensor: torch.Tensor, peer: int, group: Any) -> None:
            posted.append((fn.__name__, int(tensor[0])))

    class FakeWork:
        def wait(self) -> bool:
            return True

    monkeypatch.setattr(torch_p2p.dist, "P2POp", FakeOp)
    monkeypatch.setattr(torch_p2p.dist, "batch_isend_irecv", lambda ops: [FakeWork() for _ in ops])
    works = torch_p2p.batched_p2p_ops_fixed(
        tensor_send_prev=torch.tensor([1]),
        tensor_recv_prev=torch.tensor([2]),
        tensor_send_next=torch.tensor([3]),
        tensor_recv_next=torch.tensor([4]),
        group=None,
        prev_pipeline_rank=1,
        next_pipeline_rank=1,
    )
    # Same peer both ways (PP=2): FIFO matching pairs A's send_next with B's recv_prev.
    assert posted == [("isend", 3), ("isend", 1), ("irecv", 2), ("irecv", 4)]
    assert all(isinstance(w, torch_p2p.HeldWork) and w.wait() for w in works)


def test_forced_torch_backend_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TITAN_PP_RDMA_BACKEND", "torch")
    state = report.report()
    assert state["backend"] == "torch" and "TITAN_PP_RDMA_BACKEND=torch" in state["why"]
    checks = {c.name: c for c in report.doctor_checks()}
    assert checks["pp_rdma.backend"].status == "ok"


def test_held_work_bounds_the_wait_and_releases_storage() -> None:
    seen: list[Any] = []

    class FakeWork:
        def wait(self, timeout: Any = None) -> bool:
            seen.append(timeout)
            return True

    held = torch_p2p.HeldWork(FakeWork(), keep=(torch.ones(2),), timeout_s=7)
    assert held.wait()
    assert seen[0].total_seconds() == 7 and held._keep == ()


def test_frame_tags_are_hmac_sha256_of_header_and_body_from_a_cached_keyed_state() -> None:
    """The keyed state is reused across frames (a copy per frame): the tags must be exactly the
    one-shot HMAC's, per key, and the cache of keyed states must stay bounded."""
    import hashlib
    import hmac
    import struct

    from titan_pp_rdma import security

    keys = [bytes([i]) * 32 for i in range(3)]
    for body in (b"", b"S|f|float32:4|0|4096", bytes(range(256)) * 300):
        for counter in (0, 1, 2**40):
            for key in keys:
                header = struct.pack("!QQQ", 3, 4, counter)
                expected = hmac.digest(key, header + body, hashlib.sha256)[:16]
                assert security.mac(key, 3, 4, counter, body) == expected
                assert security.verify(key, 3, 4, counter, body, expected)
                assert not security.verify(key, 4, 3, counter, body, expected)
    assert security.mac(keys[0], 0, 1, 0, b"x") != security.mac(keys[1], 0, 1, 0, b"x")
    for i in range(200):
        security.mac(i.to_bytes(32, "big"), 0, 1, 0, b"x")
    assert len(security._KEYED) <= security._MAX_KEYED
