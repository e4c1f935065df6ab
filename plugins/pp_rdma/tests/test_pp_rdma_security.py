"""Issue 14 item 3: pp_rdma on the network, tried as an attacker would.

- every listening socket of a rank (Mooncake's RPC/handshake and data ports, and ours) is bound
  to the interface the job uses, never the wildcard, checked with ``ss -ltnp``;
- a third process that knows the ranks' endpoints (as ``ss -ltn`` or a port scan would tell it)
  but not the job's secret sends forged and malformed notifications (the issue's ``F|f|9999``
  and forged ``S`` announces, garbage, a flood for unknown sessions) while a PP=2 x VPP=2 tiny
  GPT trains: training goes on bit-identically to the same run without the attacker, and every
  rank reports what it rejected.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from titan_pp_rdma.probe import probe_mooncake

MOONCAKE = probe_mooncake()
pytestmark = pytest.mark.skipif(not MOONCAKE.available, reason=MOONCAKE.detail)
ATTACKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attacker.py")
ENV = {
    "TITAN_PP_RDMA_BACKEND": "mooncake",
    "TITAN_PP_RDMA_TIMEOUT_S": "60",
    # ring slots stay registered for the whole run, so the attacker always finds an address
    # Mooncake accepts its notifications for
    "TITAN_PP_RDMA_BUFFERS": "ring",
    "TITAN_PP_RDMA_INLINE_BYTES": "0",
}
CONFIG = dict(batch_p2p_comm=False, overlap_p2p_comm=True, deallocate_pipeline_outputs=True)
STEPS = 3


# ------------------------------------------------------------------------------ listeners
def listeners_main() -> None:
    """Script mode: start this rank's transport endpoints, print its listening sockets."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MC_LOG_LEVEL="ERROR")
    from titan_pp_rdma.channel import open_listener
    from titan_pp_rdma.mooncake_engine import MooncakeEngine
    from titan_pp_rdma.settings import PPRdmaSettings

    engine = MooncakeEngine(PPRdmaSettings(backend="mooncake", timeout_s=30))
    ours = open_listener(engine.host)  # the control listener a session setup opens
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, check=True).stdout
    mine = [line.split() for line in out.splitlines() if f"pid={os.getpid()}," in line]
    print(json.dumps({"listen": [fields[3] for fields in mine], "ours": bool(ours)}), flush=True)
    os._exit(0)


@pytest.mark.skipif(shutil.which("ss") is None, reason="iproute2's ss is not installed")
def test_listeners_bound_to_the_job_interface() -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env.pop("TITAN_PP_RDMA_HOST", None)
    out = subprocess.run(
        [sys.executable, __file__, "listeners"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stderr[-2000:]
    listen = json.loads(lines[-1])["listen"]
    # Mooncake's RPC/handshake port, its TCP data port and our control listener.
    assert len(listen) >= 3, listen
    for local in listen:
        host = local.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", "[::ffff:127.0.0.1]"), f"{local} listens beyond loopback"


# ------------------------------------------------------------------------------ attacker
def _victims(cfg: Any) -> list[dict]:
    """Rank 0's view of both ranks' endpoints, as an attacker on the host could learn them."""
    import torch.distributed as dist
    from titan_pp_rdma import session as session_mod
    from titan_pp_rdma.wire import tensor_key

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    session = next(s for s in session_mod.STATE.sessions.values() if s.transport is not None)
    tr = session.transport
    me = dist.get_rank()
    peer = next(iter(tr.links))
    key = tensor_key((tiny_gpt.SEQ, tiny_gpt.MBS, cfg.hidden_size), cfg.pipeline_dtype)
    # The control listeners closed once the neighbours connected: nothing of ours to reach, so
    # the attacker tries the port the session published (connection refused is the answer).
    return [
        {
            "segment": tr.engine.session_id,
            "addr": 0,
            "names": [f"{tr.tag}/{peer}"],
            "keys": [key],
            "control": [tr.engine.host, tr.links[peer].channel.sock.getsockname()[1]],
        },
        {
            "segment": tr.links[peer].segment,
            "addr": 0,
            "names": [f"{tr.tag}/{me}"],
            "keys": [key],
            "control": list(tr.links[peer].channel.sock.getpeername()[:2]),
        },
    ]


def attacked_train_task(attack: bool) -> dict:
    """PP=2 x VPP=2 tiny GPT over Mooncake; with ``attack``, rank 0 unleashes the attacker after
    the first step (the forged messages then wait in the ranks' inboxes as the next steps run)."""
    import torch.distributed as dist
    from titan_pp_rdma.report import report

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing import plugin_active

    tiny_gpt.init_parallel(pp=2, vpp=2)
    result: dict[str, Any] = {"attacker": None}
    before = report().get("rejected", {})
    with plugin_active("pp_rdma", env=ENV):
        cfg = tiny_gpt.make_config(**CONFIG)
        chunks = tiny_gpt.build_model(cfg, vpp=2)
        optimizer = tiny_gpt.make_optimizer(chunks, cfg)
        losses, norms = [], []
        for step in range(STEPS):
            got = tiny_gpt.train(chunks, cfg, steps=1, num_microbatches=4, optimizer=optimizer)
            losses += got[0]
            norms += got[1]
            if attack and step == 0 and dist.get_rank() == 0:
                out = subprocess.run(
                    [sys.executable, ATTACKER, json.dumps(_victims(cfg))],
                    capture_output=True,
                    text=True,
                    timeout=400,
                    env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
                )
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                result["attacker"] = json.loads(lines[-1]) if lines else out.stderr[-2000:]
        result["report"] = report()
        after = result["report"].get("rejected", {})
        result["rejected"] = sum(after.values()) - sum(before.values())
    grads = {k: v for k, v in tiny_gpt.state_snapshot(chunks).items() if k.endswith(".grad")}
    return {**result, "losses": losses, "norms": norms, "grads": grads}


def test_forged_notifications_do_not_disturb_training(gloo_pool2: Any) -> None:
    clean = gloo_pool2.run(attacked_train_task, False, timeout=600)
    attacked = gloo_pool2.run(attacked_train_task, True, timeout=600)
    attacker = attacked[0]["attacker"]
    assert isinstance(attacker, dict), attacker
    # The attack reached the victims (else this test proves nothing).
    assert attacker["mooncake_delivered"] > 0, attacker
    for rank, (got, exp) in enumerate(zip(attacked, clean, strict=True)):
        assert got["losses"] == exp["losses"], f"rank {rank}: losses differ under attack"
        assert got["norms"] == exp["norms"], f"rank {rank}: grad norms differ under attack"
        for name, grad in exp["grads"].items():
            assert got["grads"][name].equal(grad), f"rank {rank}: grad {name} differs"
        assert got["report"]["backend"] == "mooncake", got["report"]
    rejected = sum(r["rejected"] for r in attacked)
    delivered = attacker["mooncake_delivered"] + attacker["control_delivered"]
    assert rejected >= delivered, (rejected, attacker, [r["report"] for r in attacked])
    assert [r["rejected"] for r in clean] == [0, 0]


if __name__ == "__main__":
    if sys.argv[1] == "listeners":
        listeners_main()
