"""Weight sync (plugin ``weight_sync``): time to move N MB of trained weights from a trainer into
one and into two CPU SGLang engines, against two paths measured in the same run.

- ``titan``: ``WeightSync.sync``. One-sided Mooncake TCP writes into each engine's landing
  region, the BLAKE3 check, then SGLang's own loader. Timed from the first hello until every
  engine serves again: pause, flush, begin, commit, end and continue are all included.
- ``broadcast``: SGLang's own ``update_weights_from_distributed`` over a gloo group, slime's
  default path. ``pause_generation``, ``flush_cache`` and ``begin_weight_update`` (where SGLang
  has it: not 0.5.15.post1) run first. Then, per bucket of at most 512 MiB (slime's default
  ``--update-weight-buffer-size``), the engines receive every tensor of the bucket while the
  trainer broadcasts them. ``end_weight_update`` and ``continue_generation`` follow. The trainer
  side runs in the SGLang venv, because it needs SGLang's ``init_custom_process_group``, as
  slime's does.
- ``raw_write``: Mooncake writes of the same bytes from one registered buffer into a registered
  buffer of another process, one per engine, all at once (the core's write, as titan's). This is
  the transport's limit, with no protocol and no check.

The model is Llama-shaped: hidden 1024, 8 heads, FFN 4096, vocabulary 8192, bf16, and as many
layers as make N MB. Engines start from its checkpoint (step 0). Each round syncs freshly
perturbed weights. After the last titan round, a second engine loads the same weights from disk
with SGLang's ``update_weights_from_disk``, and its per-token logprobs must equal the synced
engine's bit for bit (``logprobs_identical``).

Usage: python benchmarks/weight_sync.py [--mb 256] [--engines 1,2] [--rounds 3] [--json FILE]
Goal at 1 GB: titan <= 0.5x broadcast and <= 1.2x raw write.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import loadguard
import torch
from titan_weight_sync.cpu_engine import CPUEngine, prepare_sglang_python, sglang_python
from titan_weight_sync.hf_checkpoint import save_checkpoint
from titan_weight_sync.settings import WeightSyncSettings
from titan_weight_sync.trainer_side import WeightSync

from titan_plugins.transport import auth
from titan_plugins.transport.mooncake import MooncakeEngine, free_port

HIDDEN, HEADS, FFN, VOCAB = 1024, 8, 4096, 8192
LAYER_MB = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN) * 2 / 2**20
BUCKET_BYTES = 512 << 20
PROMPTS = [[1, 5, 6, 7], [3, 9, 27, 81, 2]]


def model(mb: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Random bf16 weights of about ``mb`` MB and their Llama ``config.json``."""
    fixed_mb = 2 * VOCAB * HIDDEN * 2 / 2**20
    layers = max(1, round((mb - fixed_mb) / LAYER_MB))
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": weight(VOCAB, HIDDEN),
        "lm_head.weight": weight(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"{p}self_attn.{name}.weight"] = weight(HIDDEN, HIDDEN)
        weights[f"{p}mlp.gate_proj.weight"] = weight(FFN, HIDDEN)
        weights[f"{p}mlp.up_proj.weight"] = weight(FFN, HIDDEN)
        weights[f"{p}mlp.down_proj.weight"] = weight(HIDDEN, FFN)
        weights[f"{p}input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        weights[f"{p}post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "head_dim": HIDDEN // HEADS, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    return weights, config


def perturbed(weights: dict[str, torch.Tensor], round_: int) -> dict[str, torch.Tensor]:
    """New weights for a round (every byte changes: nothing is sent twice by luck)."""
    return {n: (t.float() * (1.0 + 0.01 * (round_ + 1))).to(t.dtype) for n, t in weights.items()}


# ----- broadcast: the trainer in the SGLang venv (SGLang's own process-group helper) ---------
BROADCASTER = textwrap.dedent(
    """
    import json, sys, torch
    from sglang.srt.utils import init_custom_process_group
    job = json.loads(sys.stdin.readline())
    group = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{job['port']}",
        world_size=job["world_size"], rank=0, group_name=job["group"])
    print("READY", flush=True)
    while True:
        line = sys.stdin.readline()
        if not line or line.strip() == "EXIT":
            break
        bucket = json.loads(line)
        gen = torch.Generator().manual_seed(bucket["seed"])
        for shape in bucket["shapes"]:
            tensor = (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
            torch.distributed.broadcast(tensor, src=0, group=group)
        print("DONE", flush=True)
    """
)


class Broadcast:
    """slime's default path: engines join a gloo group with the trainer as rank 0."""

    def __init__(self, engines: list[CPUEngine], weights: dict[str, torch.Tensor]) -> None:
        self.engines = engines
        self.session = engines[0].client.has_session()  # SGLang 0.5.15.post1 has none
        port = free_port()
        self.proc = subprocess.Popen(
            [sglang_python(), "-c", BROADCASTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        job = {"port": port, "world_size": len(engines) + 1, "group": "bench"}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        joins = [
            threading.Thread(
                target=e.api.require,
                args=("/init_weights_update_group", {
                    "master_address": "127.0.0.1", "master_port": port, "rank_offset": i + 1,
                    "world_size": len(engines) + 1, "group_name": "bench", "backend": "gloo",
                }),
            )
            for i, e in enumerate(engines)
        ]  # fmt: skip
        for t in joins:
            t.start()
        assert self.proc.stdout.readline().strip() == "READY"
        for t in joins:
            t.join()
        self.buckets: list[list[tuple[str, list[int]]]] = [[]]
        used = 0
        for name, tensor in weights.items():
            nbytes = tensor.numel() * 2
            if used and used + nbytes > BUCKET_BYTES:
                self.buckets.append([])
                used = 0
            self.buckets[-1].append((name, list(tensor.shape)))
            used += nbytes

    def sync(self, round_: int, version: str) -> None:
        """One update, timed by the caller."""
        for e in self.engines:
            e.api.require("/pause_generation", {"mode": "retract"})
            e.api.require("/flush_cache")
            if self.session:
                e.api.require("/begin_weight_update")
        for index, bucket in enumerate(self.buckets):
            body = {
                "names": [n for n, _ in bucket], "dtypes": ["bfloat16"] * len(bucket),
                "shapes": [s for _, s in bucket], "group_name": "bench", "weight_version": version,
            }  # fmt: skip
            calls = [
                threading.Thread(
                    target=e.api.require, args=("/update_weights_from_distributed", body)
                )
                for e in self.engines
            ]  # noqa: E501
            for t in calls:
                t.start()
            seed = round_ * 1000 + index
            self.proc.stdin.write(json.dumps({"seed": seed, "shapes": body["shapes"]}) + "\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "DONE"
            for t in calls:
                t.join()
        for e in self.engines:
            if self.session:
                e.api.require("/end_weight_update")
            e.api.require("/continue_generation")

    def close(self) -> None:
        """End the trainer side (the engines' group goes with them)."""
        self.proc.stdin.write("EXIT\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


# ----- raw Mooncake write ---------------------------------------------------------------------
TARGET = textwrap.dedent(
    """
    import sys, torch
    from mooncake.engine import TransferEngine
    nbytes = int(sys.argv[1])
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = torch.empty(nbytes, dtype=torch.uint8)
    assert te.register_memory(buf.data_ptr(), nbytes) == 0
    print(f"127.0.0.1:{te.get_rpc_port()} {buf.data_ptr()}", flush=True)
    sys.stdin.readline()
    """
)


def raw_write_s(nbytes: int, targets: int, rounds: int, settings: WeightSyncSettings) -> float:
    """Median seconds of one-sided writes of ``nbytes`` into each of ``targets`` processes."""
    procs = [
        subprocess.Popen([sglang_python(), "-c", TARGET, str(nbytes)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(targets)
    ]  # fmt: skip
    try:
        peers = [p.stdout.readline().split() for p in procs]
        engine = MooncakeEngine(settings, who="benchmark")
        source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        engine.register(source)
        times = []
        for _ in range(rounds):
            # every target at once, as titan writes to its engines
            writes = [
                threading.Thread(
                    target=engine.write, args=(session, [source.data_ptr()], [int(addr)], [nbytes])
                )
                for session, addr in peers
            ]
            start = time.perf_counter()
            for t in writes:
                t.start()
            for t in writes:
                t.join()
            times.append(time.perf_counter() - start)
        engine.unregister(source)
        return statistics.median(times)
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=60)


def run(mb: int, engines_n: int, rounds: int, work: Path) -> dict[str, Any]:
    """One configuration: ``mb`` MB into ``engines_n`` engines."""
    weights, config = model(mb)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    checkpoint = save_checkpoint(weights, config, work / f"model_{mb}", torch.bfloat16)
    secret = str(work / f"secret_{mb}_{engines_n}")
    auth.write_secret(secret)
    env = {"TITAN_WEIGHT_SYNC_SECRET_FILE": secret, "TITAN_PLUGINS_MAX_HOST_BYTES": "8GiB"}
    # SGLang's CPU memory fraction must hold the weights and a small KV cache (24 GB machine)
    args = ("--mem-fraction-static", f"{max(0.05, 0.12 * mb / 1024 + 0.03):.2f}")
    engines = [
        CPUEngine(checkpoint, work / f"engine_{mb}_{i}.log", env, args) for i in range(engines_n)
    ]
    settings = WeightSyncSettings(protocol="tcp", host="127.0.0.1", secret_file=secret)
    try:
        for e in engines:
            e.wait_ready(timeout_s=600)
        sync = WeightSync([e.url for e in engines], settings)
        titan, phases, last = [], [], None
        for r in range(rounds):
            last = perturbed(weights, r)
            start = time.perf_counter()
            result = sync.sync(last, f"titan-{r}")
            titan.append(time.perf_counter() - start)
            phases.append(result.seconds)
        sync.close()
        # item 3's check: the synced engine against one that loads the same weights from disk
        check = save_checkpoint(last, config, work / f"model_{mb}_last", torch.bfloat16)
        synced_out = engines[0].client.generate(PROMPTS)
        if engines_n > 1:
            reference = engines[1]
            reference.client.load_from_disk(check, "disk")
            identical = synced_out == reference.client.generate(PROMPTS)
        else:
            engines[0].client.load_from_disk(check, "disk")
            identical = synced_out == engines[0].client.generate(PROMPTS)
        broadcast = Broadcast(engines, weights)
        times = []
        for r in range(rounds):
            start = time.perf_counter()
            broadcast.sync(r, f"broadcast-{r}")
            times.append(time.perf_counter() - start)
        broadcast.close()
        raw = raw_write_s(nbytes, engines_n, rounds, settings)
    finally:
        for e in engines:
            e.stop()
    return {
        "mb": round(nbytes / 2**20, 1),
        "engines": engines_n,
        "titan_s": statistics.median(titan),
        "broadcast_s": statistics.median(times),
        "raw_write_s": raw,
        "logprobs_identical": identical,
        "titan_rounds_s": titan,
        "titan_phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "broadcast_rounds_s": times,
    }


def main() -> int:
    """Parse, run every configuration, print ratios, write ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[256], help="model sizes in MB")
    parser.add_argument("--engines", default="1,2", help="engine counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    loadguard.add_arguments(parser)
    args = parser.parse_args()
    # the engines run in the SGLang venv: made here when the checkout has none yet
    if prepare_sglang_python(say=lambda line: print(line, file=sys.stderr, flush=True)) is None:
        return 2
    print(f"weight_sync benchmark  {loadguard.describe(args)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="titan-weight-sync-bench-") as work:
        for mb in args.mb:
            for n in (int(x) for x in args.engines.split(",")):
                row = run(mb, n, args.rounds, Path(work))
                results.append(row)
                print(
                    f"{row['mb']:8.1f} MB -> {n} engine(s): titan {row['titan_s']:.3f} s, "
                    f"broadcast {row['broadcast_s']:.3f} s, raw write {row['raw_write_s']:.3f} s;"
                    f" titan/broadcast {row['titan_s'] / row['broadcast_s']:.2f}x, "
                    f"titan/raw {row['titan_s'] / row['raw_write_s']:.2f}x; logprobs identical: "
                    f"{row['logprobs_identical']}",
                    flush=True,
                )
                print(
                    "    titan phases (median s): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in row["titan_phases_s"].items())
                )
                if row["mb"] >= 1000:
                    met = row["titan_s"] <= 0.5 * row["broadcast_s"] and (
                        row["titan_s"] <= 1.2 * row["raw_write_s"]
                    )
                    print(
                        f"    goal (<= 0.5x broadcast, <= 1.2x raw): {loadguard.verdict(met, args)}"
                    )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=1))
    return 0 if all(r["logprobs_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
