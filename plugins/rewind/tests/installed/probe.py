"""Run inside a fresh venv holding only titan-plugins and titan-rewind: train the tiny GPT at
world size 1 through the automatic channel with a NaN injected, print what happened as
``PROBE {json}``."""

from __future__ import annotations

import json
import socket


def main() -> None:
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import megatron.core  # noqa: F401  # the registry activates here (torch.backends channel)
    import titan_rewind

    from titan_plugins import report
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    plugins = {p["name"]: p["state"] for p in report.collect()["plugins"]}
    tiny_gpt.init_parallel()
    cfg = tiny_gpt.make_config()
    losses, _ = tiny_gpt.train(tiny_gpt.build_model(cfg), cfg, 8)
    effect = titan_rewind.effect()
    print("PROBE " + json.dumps({"plugins": plugins, "effect": effect, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
