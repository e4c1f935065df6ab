"""A third process that attacks a running pp_rdma pipeline (run as a script by the tests).

``python attacker.py '<json>'`` where the JSON is a list of victims, each
``{"segment": "host:port", "addr": int, "names": [...], "keys": [...], "control": [host, port] |
null}``:
``segment`` is the victim's Mooncake segment (its RPC port, which anyone who can reach it may
find with ``ss -ltn`` or a port scan), ``addr`` an address inside memory the victim registered
with Mooncake (0: ask Mooncake's handshake for the first one), ``names`` the notification names
to forge (``"<session tag>/<rank>"`` of the victim's pipeline peers) and ``control`` the
victim's own control listener, if it has one open; ``keys`` the tensor keys to announce
(``"float32:16x2x64"``: an attacker can guess the shapes of a known model).

It sends, without knowing the job's secret:
- through Mooncake notifications (what the transport used to trust): the issue's forged
  ``F|f|9999``, forged announces ``S`` for the next sequence numbers of both channels pointing
  at the victim's registered memory, malformed fields, garbage names and messages, and a flood
  for sessions that do not exist;
- to the control listener: garbage bytes, a frame with a wrong MAC, an absurd length prefix and
  a connection that never speaks.
Prints one JSON line: how many of each were delivered (accepted by the victim's socket).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

SEQS = 32  # forged announces cover the next sequence numbers of the running job
FLOOD = 100  # notifications for unknown sessions: the victim must not keep them all


def notifications(tag_names: list[str], keys: list[str], addr: int) -> list[tuple[str, str]]:
    """The forged and malformed ``(name, msg)`` pairs for one victim."""
    out: list[tuple[str, str]] = []
    for name in tag_names:
        out.append((name, "F|f|9999"))  # the case: a raw KeyError killed rank 0
        out += [(name, f"F|{ch}|{seq}") for ch in "fb" for seq in range(4)]
        for key in keys:  # announce bytes the victim would read from an address we chose
            out += [(name, f"S|{ch}|{key}|{seq}|{addr}") for ch in "fb" for seq in range(SEQS)]
        out += [(name, msg) for msg in ("", "S", "S|f", "S|f|x|y|z", "D|f|0|1", "E")]
        out += [(name, "S|f|float32:4|zero|" + "9" * 40), (name, "\x00\xff|" * 20)]
    out += [("no-slash-at-all", "F|f|0"), ("/", "S|f|float32:1|0|0"), ("x" * 300, "y" * 300)]
    out += [(f"titan_pp_rdma/7-8/{i}/7", f"F|f|{i}") for i in range(FLOOD)]
    return out


def attack_mooncake(victims: list[dict]) -> dict[str, int]:
    """Forge notifications through a TransferEngine of our own."""
    import torch
    from mooncake.engine import TransferEngine, TransferNotify

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        return {"mooncake_setup_failed": 1}
    src = torch.zeros(8, dtype=torch.uint8)
    te.register_memory(src.data_ptr(), 8, "*")
    sent = failed = 0
    for victim in victims:
        addr = int(victim.get("addr") or 0) or te.get_first_buffer_address(victim["segment"])
        for name, msg in notifications(victim["names"], victim["keys"], addr):
            rc = te.transfer_sync(
                victim["segment"],
                src.data_ptr(),
                addr,
                0,
                TransferEngine.TransferOpcode.Write,
                TransferNotify(name, msg),
            )
            sent, failed = (sent + 1, failed) if rc == 0 else (sent, failed + 1)
    return {"mooncake_delivered": sent, "mooncake_failed": failed}


def attack_control(victims: list[dict]) -> dict[str, int]:
    """Talk to the victims' own control listeners without the secret."""
    delivered = refused = 0
    idle: list[socket.socket] = []
    for victim in victims:
        if not victim.get("control"):
            continue
        host, port = victim["control"]
        payloads = [
            os.urandom(256),
            struct.pack("!I", 2**31) + b"x" * 64,  # absurd length
            # a well-formed frame (length, body, 16-byte tag) whose MAC is not keyed by the secret
            struct.pack("!I", 40) + b"H|titan_pp_rdma/0-1/0|1|0|".ljust(24, b"0") + b"\x00" * 16,
            b"F|f|9999\n" * 8,
        ]
        for payload in payloads:
            try:
                with socket.create_connection((host, port), timeout=2) as s:
                    s.sendall(payload)
                    delivered += 1
            except OSError:
                refused += 1
        try:
            idle.append(socket.create_connection((host, port), timeout=2))  # never speaks
        except OSError:
            refused += 1
    time.sleep(0.5)
    for s in idle:
        s.close()
    return {"control_delivered": delivered, "control_refused": refused}


def main() -> None:
    victims = json.loads(sys.argv[1])
    result = attack_mooncake(victims)
    result.update(attack_control(victims))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
