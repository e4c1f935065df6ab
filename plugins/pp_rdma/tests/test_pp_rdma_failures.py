"""Sessions and failures: clear errors, bounded in time, never a hang.

- shape / dtype mismatch between stages, through the real communicator (shared gloo pool);
- a peer that never joins the handshake, one that hangs mid-step and one killed mid-step (a
  separate process pair, so the shared pool is not disturbed): the survivor raises within
  TITAN_PP_RDMA_TIMEOUT_S (at once for the killed one: its control connection closes);
- the optional metadata-server mode (Mooncake's HTTP server) instead of P2PHANDSHAKE.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
from titan_pp_rdma.probe import probe_mooncake

MOONCAKE = probe_mooncake()
pytestmark = pytest.mark.skipif(not MOONCAKE.available, reason=MOONCAKE.detail)
TIMEOUT_S = 3.0
LONG_TIMEOUT_S = 30.0
# An error raised by the timeout comes after TIMEOUT_S and long before any other clock runs out
# (LONG_TIMEOUT_S, gloo's 30 minutes): the bound leaves room for a loaded machine's scheduling.
WITHIN_S = TIMEOUT_S + 15


def mismatch_task(recv_shape: list[int], recv_dtype: str, buffers: str) -> str:
    """Rank 0 sends a (4, 2, 16) float32 activation; rank 1 expects ``recv_shape``/``recv_dtype``."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from titan_pp_rdma import session
    from titan_pp_rdma.communicator import build_communicator_class

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing.activation import environ

    tiny_gpt.init_parallel(pp=2)
    rank = ps.get_pipeline_model_parallel_rank()
    dtype = torch.float32 if rank == 0 else getattr(torch, recv_dtype)
    config = SimpleNamespace(
        pipeline_dtype=dtype,
        variable_seq_lengths=False,
        mtp_standalone=False,
        use_ring_exchange_p2p=False,
        batch_p2p_comm=True,
        batch_p2p_sync=False,
        virtual_pipeline_model_parallel_size=None,
        timers=None,
    )
    env = {
        "TITAN_PP_RDMA_BACKEND": "mooncake",
        "TITAN_PP_RDMA_TIMEOUT_S": "20",
        "TITAN_PP_RDMA_BUFFERS": buffers,
    }
    try:
        with environ(env):
            comm = build_communicator_class(P2PCommunicator)(
                ps.get_pipeline_model_parallel_group(), config
            )
            if rank == 0:
                comm.send_forward(torch.ones(4, 2, 16), is_last_stage=False)
                comm.recv_backward([4, 2, 16], is_last_stage=False)  # learns of the peer's error
            else:
                comm.recv_forward(recv_shape, is_first_stage=False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        session.reset()
    return "no error"


@pytest.mark.parametrize("buffers", ["direct", "ring"])
@pytest.mark.parametrize(
    ("shape", "dtype", "expected"),
    [
        ([4, 2, 8], "float32", "shape (4, 2, 8) dtype torch.float32"),
        ([4, 2, 16], "bfloat16", "shape (4, 2, 16) dtype torch.bfloat16"),
    ],
)
def test_mismatch_names_both_sides(
    gloo_pool2: Any, shape: list, dtype: str, expected: str, buffers: str
) -> None:
    errors = gloo_pool2.run(mismatch_task, shape, dtype, buffers, timeout=120)
    sent = "shape (4, 2, 16) dtype torch.float32"
    # The receiver compares the announced shape/dtype with its own before moving a byte; the
    # sender hears of it through the transport instead of waiting forever.
    assert errors[1].startswith("PPRdmaMismatch"), errors
    assert errors[0].startswith("PPRdmaError"), errors
    for error in errors:
        assert expected in error and sent in error and "rank 0" in error, error


# ----------------------------------------------------------------- separate process pair
def pair_main(scenario: str, rank: int, port: int) -> None:
    """One rank of the pair (run as a script); prints one JSON line, then exits hard."""
    import torch
    import torch.distributed as dist
    from titan_pp_rdma.session import _engine, open_session
    from titan_pp_rdma.settings import PPRdmaSettings
    from titan_pp_rdma.wire import BWD, FWD

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    metadata = os.environ.get("TITAN_PP_RDMA_METADATA", "P2PHANDSHAKE")
    # only the timeouts under test are short; elsewhere a long one, so that an error raised
    # well before it cannot have come from the clock (whatever the machine's load)
    timeout_s = TIMEOUT_S if scenario in ("never_joins", "hangs") else LONG_TIMEOUT_S
    settings = PPRdmaSettings(backend="mooncake", timeout_s=timeout_s, metadata=metadata)
    result: dict[str, Any] = {"rank": rank}
    if scenario != "never_joins" or rank == 0:
        _engine(settings)  # set up before the clock starts: only the waits are timed
    start = time.monotonic()
    try:
        if scenario == "exchange":  # both directions at once, as a PP=2 stage pair does
            session = open_session(dist.group.WORLD, settings)
            result["why"] = session.why
            n = 1 << 15  # 128 KiB: a Mooncake read, not an inline message
            x = torch.arange(n, dtype=torch.float32) * (rank + 1)
            for step in range(3):
                y = torch.empty(n)
                ch_out, ch_in = (FWD, BWD) if rank == 0 else (BWD, FWD)
                ops = [session.transport.isend(x + step, 1 - rank, ch_out)]
                ops.append(session.transport.irecv(y, 1 - rank, ch_in))
                for op in ops:
                    op.wait()
                assert y.equal(torch.arange(n, dtype=torch.float32) * (2 - rank) + step)
            result["ok"] = True
            print(json.dumps(result), flush=True)
            # A normal exit: the notifier's atexit flush must deliver the last "read done", or
            # the peer's last send never completes (no barrier here: that would hide it).
            dist.destroy_process_group()
            sys.exit(0)
        elif scenario == "never_joins" and rank == 1:
            time.sleep(TIMEOUT_S + 3)  # alive, but never starts the pipeline
        else:
            tr = open_session(dist.group.WORLD, settings).transport
            x = torch.arange(1024, dtype=torch.float32)
            for step in range(3):
                if rank == 0:
                    if step == 2 and scenario == "killed":  # after posting nothing for step 2
                        print(json.dumps(result), flush=True)
                        os._exit(0)
                    if step == 2:  # hangs: alive, connected, silent
                        time.sleep(TIMEOUT_S + 3)
                        break
                    tr.isend(x + step, 1, FWD).wait()
                else:
                    start = time.monotonic()
                    y = torch.empty(1024)
                    tr.irecv(y, 0, FWD).wait()
                    assert y.equal(x + step)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["elapsed"] = time.monotonic() - start
    print(json.dumps(result), flush=True)
    os._exit(0)  # a dead peer can leave gloo's teardown waiting


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(scenario: str, **extra_env: str) -> list[dict]:
    port = _free_port()
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1", **extra_env}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        for rank in (0, 1)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=60 + TIMEOUT_S)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert lines, f"{scenario}: a rank printed no result"
        out.append(json.loads(lines[-1]))
    return out


def test_peer_that_never_joins_times_out() -> None:
    first, _ = _run_pair("never_joins")
    assert first["error"].startswith("PPRdmaTimeout"), first
    assert "ranks [1] did not join" in first["error"] and "TIMEOUT_S" in first["error"]
    assert TIMEOUT_S - 0.1 < first["elapsed"] < WITHIN_S, first


def test_peer_that_hangs_mid_step_times_out() -> None:
    _, survivor = _run_pair("hangs")
    assert survivor["error"].startswith("PPRdmaTimeout"), survivor
    assert "receive from rank 0" in survivor["error"], survivor
    assert "never announced the tensor" in survivor["error"], survivor
    assert TIMEOUT_S - 0.1 < survivor["elapsed"] < WITHIN_S, survivor


def test_peer_killed_mid_step_raises_at_once() -> None:
    _, survivor = _run_pair("killed")
    assert survivor["error"].startswith("PPRdmaError"), survivor
    assert "pipeline rank 0 closed the connection" in survivor["error"], survivor
    # its timeout is LONG_TIMEOUT_S: an error this early came from the closed connection
    assert survivor["elapsed"] < LONG_TIMEOUT_S / 2, survivor


HTTP_METADATA_SERVER = os.path.join(
    os.path.dirname(sys.executable), "mooncake_http_metadata_server"
)


@pytest.mark.skipif(
    not os.path.exists(HTTP_METADATA_SERVER),
    reason="mooncake_http_metadata_server is not installed with this Mooncake wheel",
)
def test_http_metadata_server_session() -> None:
    """The optional metadata mode: Mooncake's bundled HTTP server instead of P2PHANDSHAKE."""
    server_bin = HTTP_METADATA_SERVER
    port = _free_port()
    server = subprocess.Popen(
        [server_bin, "--host", "127.0.0.1", "--port", str(port), "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "metadata server did not start"
                time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/metadata"
        results = _run_pair("exchange", TITAN_PP_RDMA_METADATA=url)
    finally:
        server.terminate()
        server.wait(timeout=30)
    for result in results:
        assert result.get("ok"), result
        assert url in result["why"], result


if __name__ == "__main__":
    pair_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
