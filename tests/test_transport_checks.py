"""The core's transport checks refuse by name what cannot work, and never hang: an address that
does not resolve or is not this host's, an RDMA NIC that does not exist, a secret file that is
not a regular owner-only file (a FIFO included), a long path shortened in every message."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from titan_plugins.transport import addresses, auth, bind_guard
from titan_plugins.values import shown_value

pytestmark = pytest.mark.line_independent

TEST_NET = "192.0.2.1"  # RFC 5737 documentation range: never an address of this host


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("999.1.1.1", "not an IPv4 address (four numbers from 0 to 255, e.g. 10.0.0.5)"),
        ("10.1.2", "not an IPv4 address (four numbers from 0 to 255, e.g. 10.0.0.5)"),
        ("0.0.0.0", "a wildcard is not an address peers can reach"),
        ("bad host!", "not an IP address or host name"),
    ],
)
def test_a_host_that_cannot_be_an_address_is_refused_by_its_form(value: str, why: str) -> None:
    assert (addresses.host_problem(value) or "").startswith(why)
    assert (addresses.local_host_problem(value) or "").startswith(why)


def test_names_and_addresses_that_are_not_this_hosts_are_refused() -> None:
    assert addresses.local_host_problem("127.0.0.1") is None
    assert addresses.local_host_problem("localhost") is None
    assert addresses.local_address("localhost") in ("127.0.0.1", "::1")
    assert addresses.local_host_problem(TEST_NET) == (
        "is not an address of this host: give this host's own address on the job's network "
        "(e.g. from `hostname -I`)"
    )
    unresolved = addresses.local_host_problem("no-such-host.invalid")  # RFC 6761: never resolves
    assert unresolved is not None and unresolved.startswith("does not resolve (")
    assert unresolved.endswith("): give this host's IP address on the job's network")
    # the syntax-only check (pp_rdma's knob) keeps accepting names resolved elsewhere
    assert addresses.host_problem("no-such-host.invalid") is None


def test_the_bind_guard_names_an_unresolvable_address_instead_of_a_raw_gaierror() -> None:
    with pytest.raises(bind_guard.BindGuardError) as caught:
        bind_guard._address_bytes("no-such-host.invalid")
    assert str(caught.value).startswith("the job's address 'no-such-host.invalid' does not resolve")
    with pytest.raises(bind_guard.BindGuardError, match="is not an address of this host"):
        bind_guard._address_bytes(TEST_NET)
    assert bind_guard._address_bytes("127.0.0.1")[0] == bytes([127, 0, 0, 1])


def test_rdma_nics_that_do_not_exist_are_named(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(addresses, "_INFINIBAND", str(tmp_path / "infiniband"))
    assert addresses.rdma_nics() == []
    assert addresses.absent_nic_problem("abc") == (
        f"no such RDMA device: 'abc' (this host has none: {tmp_path}/infiniband is empty or absent)"
    )
    for nic in ("mlx5_0", "mlx5_1"):
        (tmp_path / "infiniband" / nic).mkdir(parents=True)
    assert addresses.absent_nic_problem("mlx5_0, mlx5_1") is None
    assert addresses.absent_nic_problem("mlx5_0,mlx5_7,ib9") == (
        "no such RDMA devices: 'mlx5_7', 'ib9' (this host has mlx5_0, mlx5_1)"
    )
    assert addresses.absent_nic_problem("mlx5_0;reboot").startswith("not RDMA device names")


def _read_within(path: str, seconds: float = 10.0) -> str:
    """``auth.read_secret``'s refusal, failing the test (instead of hanging it) on a block."""
    outcome: list[str] = []

    def attempt() -> None:
        try:
            auth.read_secret(path, "TITAN_X")
            outcome.append("accepted")
        except auth.SecretError as err:
            outcome.append(str(err))

    reader = threading.Thread(target=attempt, daemon=True)
    reader.start()
    reader.join(seconds)
    assert outcome, f"read_secret({path!r}) blocked for {seconds} s"
    return outcome[0]


def test_a_secret_file_that_is_not_a_regular_owner_only_file_is_refused(tmp_path: Path) -> None:
    def shown(path: Path) -> str:  # pytest's paths are long: shortened as every value is
        return shown_value(str(path))

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    assert _read_within(str(fifo)).startswith(f"TITAN_X={shown(fifo)}: not a regular file (a FIFO)")
    assert _read_within(str(tmp_path)).startswith(
        f"TITAN_X={shown(tmp_path)}: not a regular file (a directory); write one with"
    )
    missing = tmp_path / "missing"
    assert _read_within(str(missing)).startswith(
        f"TITAN_X={shown(missing)}: cannot read it (No such file or directory); write one with"
    )
    shared = tmp_path / "shared"
    auth.write_secret(str(shared))
    shared.chmod(0o644)
    assert _read_within(str(shared)) == (
        f'TITAN_X={shown(shared)}: group or others may read it (mode 644); chmod 600 "$TITAN_X"'
    )
    assert auth.secret_problem(str(shared)) == (
        "group or others may read it (mode 644); chmod 600 the file"
    )
    shared.chmod(0o600)
    assert auth.secret_problem(str(shared)) is None
    assert auth.secret_problem(str(fifo)).startswith("not a regular file (a FIFO)")


def test_a_long_secret_path_is_shortened_in_the_message(tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*["d" * 100] * 4)
    deep.mkdir(parents=True)
    path = str(deep / "secret")
    message = _read_within(path)
    assert path not in message and f"({len(path)} characters)" in message
    assert message.endswith("cannot read it (No such file or directory); " + auth._HOW_TO_WRITE)
    assert len(message) < 250


def test_an_engine_on_an_address_that_is_not_this_hosts_raises_the_callers_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    from titan_plugins.transport import mooncake

    class Refused(RuntimeError):
        pass

    class Config:
        protocol, metadata, device, timeout_s = "tcp", mooncake.P2PHANDSHAKE, "", 5.0
        host = "no-such-host.invalid"

    fake = types.ModuleType("mooncake.engine")
    fake.TransferEngine = lambda: None  # type: ignore[attr-defined]  # refused before any use
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))  # none needed
    monkeypatch.setitem(sys.modules, "mooncake.engine", fake)
    for var in ("MC_TRANSFER_TIMEOUT", "MC_TCP_SLICE_SIZE", "MC_TCP_BIND_ADDRESS"):
        # The engine sets them for Mooncake (setdefault) before it binds, so they must be gone
        # again after the test: set first, so that monkeypatch records them and removes what
        # the engine wrote (a delenv of an absent name records nothing, and the session's later
        # Mooncake children inherited MC_TCP_BIND_ADDRESS=no-such-host.invalid: pp_rdma's
        # metadata-server test failed in every full run)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    with pytest.raises(Refused) as caught:
        mooncake.MooncakeEngine(Config(), who="plugin_x", error=Refused, hint="; check _HOST")
    message = str(caught.value)
    assert message.startswith("plugin_x: the job's address 'no-such-host.invalid' does not ")
    assert message.endswith("give this host's IP address on the job's network; check _HOST")


def test_the_engine_test_leaves_no_mooncake_variable_behind() -> None:
    # runs after the test above (file order): what the refused engine set is gone
    leaked = {var: os.environ[var] for var in os.environ if var.startswith("MC_TCP_BIND")}
    assert leaked == {}
