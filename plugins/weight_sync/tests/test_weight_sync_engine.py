"""weight_sync against a real CPU SGLang 0.5.23 engine (the SGLang venv), the trainer being
unmodified megatron-core trained by its own schedules on gloo workers.

One engine ("synced") receives every update over Mooncake TCP; a second ("reference") loads the
same weights through SGLang's own ``update_weights_from_disk``. After each of three updates (and
one from a TP=2 trainer) their per-token logprobs are bit-identical, and the greedy tokens equal
Hugging Face transformers' on the saved checkpoint. Megatron's own logits equal the Hugging Face
model's on the converted weights (the name and layout conversion is right). Then the faults: each
one is refused by name, and the engine keeps serving its last complete version.

These tests run in the SGLang leg of scripts/test.sh (``-m sglang``); without the SGLang venv
(``./scripts/sglang_env.sh``) they are skipped with that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from titan_weight_sync import stats, tiny_llama, wire
from titan_weight_sync.cpu_engine import CPUEngine, EngineClient, sglang_python
from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.hf_checkpoint import load_safetensors, save_checkpoint
from titan_weight_sync.megatron_export import gather_hf_weights
from titan_weight_sync.settings import WeightSyncSettings
from titan_weight_sync.trainer_side import LandingWriter, WeightSync

from titan_plugins import host_memory
from titan_plugins.hosts.megatron.testing import tiny_gpt
from titan_plugins.transport import auth
from titan_plugins.transport.mooncake import free_port

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        sglang_python() is None,
        reason="needs the SGLang venv (./scripts/sglang_env.sh); scripts/test.sh's SGLang leg "
        "runs these",
    ),
]
PROMPTS = [[1, 5, 6, 7], [3, 9, 27, 81, 2], [100, 50, 25, 12, 6, 3]]


def settings(secret_file: str, **overrides) -> WeightSyncSettings:
    """The trainer's knobs in these tests (TCP on loopback)."""
    return WeightSyncSettings(
        protocol="tcp", host="127.0.0.1", secret_file=secret_file, **overrides
    )


# ---------------------------------------------------------------- trainer tasks (gloo workers)
def initial_checkpoint_task(out_dir: str, prefix: str = "", moe: bool = False) -> dict:
    """The engines' starting checkpoint: the trainer's initial weights (and, for the conversion
    check, megatron's own fp32 logits with an fp32 copy of the checkpoint)."""
    tiny_gpt.init_parallel()
    cfg = tiny_llama.make_config(num_moe_experts=4 if moe else None)
    chunks = tiny_llama.build(cfg)
    weights = gather_hf_weights(chunks, cfg)
    config = tiny_llama.hf_config(cfg)
    save_checkpoint(weights, config, f"{out_dir}/{prefix}ckpt0", torch.bfloat16)
    save_checkpoint(weights, config, f"{out_dir}/{prefix}ckpt0_f32", torch.float32)
    ids = torch.tensor(PROMPTS[2:])
    torch.save(tiny_llama.logits(chunks, ids), f"{out_dir}/{prefix}ckpt0_megatron_logits.pt")
    return {"tensors": len(weights)}


def train_and_sync_task(
    layout: dict,
    out_dir: str,
    secret_file: str,
    synced: str,
    reference: str,
    updates: list[str],
    moe: bool = False,
) -> list[dict]:
    """Train two steps per update, gather, sync into ``synced`` and load the saved checkpoint into
    ``reference`` from disk; each update's generations from both engines (rank 0)."""
    tiny_gpt.init_parallel(**layout)
    cfg = tiny_llama.make_config(num_moe_experts=4 if moe else None)
    chunks = tiny_llama.build(cfg)
    optimizer = tiny_gpt.make_optimizer(chunks, cfg, lr=3e-3)
    sync = WeightSync([synced], settings(secret_file, staging_bytes=64 << 10))
    records = []
    try:
        for version in updates:
            losses, _ = tiny_gpt.train(chunks, cfg, steps=2, optimizer=optimizer)
            weights = gather_hf_weights(chunks, cfg)
            if not weights:
                continue  # not rank 0
            checkpoint = save_checkpoint(
                weights, tiny_llama.hf_config(cfg), f"{out_dir}/ckpt_{version}", torch.bfloat16
            )
            result = sync.sync(weights, version)
            EngineClient(reference).load_from_disk(checkpoint, version)
            records.append(
                {
                    "version": version,
                    "checkpoint": str(checkpoint),
                    "losses": losses,
                    "bytes": result.bytes_written,
                    "synced": EngineClient(synced).generate(PROMPTS),
                    "reference": EngineClient(reference).generate(PROMPTS),
                    "synced_version": EngineClient(synced).weight_version(),
                }
            )
    finally:
        sync.close()
    return records


HF_REFERENCE = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    job = json.loads(sys.argv[1])
    out = {"greedy": {}, "logits_max_diff": None}
    for path in job["checkpoints"]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        rows = []
        for prompt in job["prompts"]:
            ids = torch.tensor([prompt])
            new = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            rows.append(new[0, len(prompt):].tolist())
        out["greedy"][path] = rows
    model = AutoModelForCausalLM.from_pretrained(job["f32"], dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor(job["logits_prompts"])).logits
    mine = torch.load(job["megatron_logits"])
    out["logits_max_diff"] = (hf - mine).abs().max().item()
    out["logits_scale"] = hf.abs().max().item()
    print("RESULT" + json.dumps(out))
    """
)


def hf_reference(out_dir: Path, checkpoints: list[str], prefix: str = "") -> dict:
    """Greedy tokens of Hugging Face transformers for each checkpoint, and the largest
    difference between its fp32 logits and megatron's on the initial weights."""
    job = {
        "checkpoints": checkpoints,
        "prompts": PROMPTS,
        "f32": str(out_dir / f"{prefix}ckpt0_f32"),
        "megatron_logits": str(out_dir / f"{prefix}ckpt0_megatron_logits.pt"),
        "logits_prompts": PROMPTS[2:],
    }
    done = subprocess.run(
        [sglang_python(), "-c", HF_REFERENCE, json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert line, done.stderr[-3000:]
    return json.loads(line[0][len("RESULT") :])


# ---------------------------------------------------------------- the engines
@pytest.fixture(scope="module")
def job(tmp_path_factory, gloo_pool1):
    """A secret, the initial checkpoint and two engines serving it."""
    out = tmp_path_factory.mktemp("weight_sync")
    secret_file = str(out / "secret")
    auth.write_secret(secret_file)
    gloo_pool1.run(initial_checkpoint_task, str(out))
    env = {"TITAN_WEIGHT_SYNC_SECRET_FILE": secret_file}
    engines = [CPUEngine(out / "ckpt0", out / f"{name}.log", env) for name in ("synced", "ref")]
    try:
        for engine in engines:
            engine.wait_ready()
        yield {"dir": out, "secret": secret_file, "synced": engines[0], "reference": engines[1]}
    finally:
        for engine in engines:
            engine.stop()


def test_every_sglang_process_lists_the_registry(job) -> None:
    log = job["synced"].log.read_text(errors="replace")
    lines = [line for line in log.splitlines() if line.startswith("[titan_plugins] sglang")]
    roles = {line.split()[2] for line in lines}
    # SGLang 0.5.15.post1 loads no plugin in its detokenizer (0.5.23 does)
    has_detokenizer = job["synced"].client.has_session()
    assert {"server", "scheduler"} | ({"detokenizer"} if has_detokenizer else set()) <= roles
    assert roles <= {"server", "scheduler", "detokenizer"}, lines
    assert all("activated via sglang.srt.plugins" in line for line in lines), lines
    assert all("weight_sync (enabled)" in line for line in lines), lines


def test_three_updates_from_megatron_match_a_disk_loaded_engine_and_transformers(
    job, gloo_pool1
) -> None:
    synced, reference = job["synced"], job["reference"]
    before = synced.client.generate(PROMPTS)
    (records,) = gloo_pool1.run(
        train_and_sync_task, {}, str(job["dir"]), job["secret"], synced.url, reference.url,
        ["1", "2", "3"],
    )  # fmt: skip
    assert [r["version"] for r in records] == ["1", "2", "3"]
    assert [r["synced_version"] for r in records] == ["1", "2", "3"]
    assert records[0]["synced"] != before, "the update changed nothing the engine serves"
    assert records[0]["synced"] != records[2]["synced"]
    for record in records:
        # bit-identical logprobs: the synced engine serves exactly the saved checkpoint
        assert record["synced"] == record["reference"], record["version"]
    hf = hf_reference(job["dir"], [r["checkpoint"] for r in records])
    for record in records:
        tokens = [row["tokens"] for row in record["synced"]]
        assert tokens == hf["greedy"][record["checkpoint"]], record["version"]
    # the conversion: megatron's own fp32 logits equal the Hugging Face model's
    assert hf["logits_max_diff"] < 1e-5 * max(1.0, hf["logits_scale"]), hf
    job["last"] = records[-1]


def test_a_tp2_trainer_syncs_the_same_way(job, gloo_pool2) -> None:
    synced, reference = job["synced"], job["reference"]
    records, rest = gloo_pool2.run(
        train_and_sync_task, {"tp": 2}, str(job["dir"]), job["secret"], synced.url,
        reference.url, ["tp2-1"],
    )  # fmt: skip
    assert rest == []
    (record,) = records
    assert record["synced_version"] == "tp2-1"
    assert record["synced"] == record["reference"]
    job["last"] = record


def test_one_sync_feeds_two_engines(job) -> None:
    engines = [job["synced"], job["reference"]]
    # paused with abort (slime's choice under load), which 0.5.15.post1's scheduler never sees
    sync = WeightSync(
        [e.url for e in engines], settings(job["secret"], staging_bytes=64 << 10), "abort"
    )
    result = sync.sync(_weights(job), "both")
    sync.close()
    assert result.engines == 2 and result.bytes_written == 2 * job["last"]["bytes"]
    assert [e.client.weight_version() for e in engines] == ["both", "both"]
    first, second = (e.client.generate(PROMPTS) for e in engines)
    assert first == second


def staged_task(
    layout: dict,
    out_dir: str,
    secret_file: str,
    synced: str,
    reference: str,
    version: str,
    bad_rank: int | None = None,
) -> dict:
    """Train two steps, then every pipeline stage's source rank writes its own stage (in
    buckets of three tensors) into ``synced`` and rank 0 commits; ``bad_rank`` gives a
    wrong-shaped tensor. The reference engine loads the gathered checkpoint from disk."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from titan_weight_sync.megatron_export import local_hf_weights
    from titan_weight_sync.staged import staged_sync

    tiny_gpt.init_parallel(**layout)
    cfg = tiny_llama.make_config()
    chunks = tiny_llama.build(cfg)
    tiny_gpt.train(chunks, cfg, steps=2, optimizer=tiny_gpt.make_optimizer(chunks, cfg, lr=3e-3))
    dense, _ = local_hf_weights(chunks, cfg)
    source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    names = sorted(dense) if source else []
    if dist.get_rank() == bad_rank:
        dense[names[-1]] = torch.zeros(3, 3)
    pieces = [{n: dense[n] for n in names[i : i + 3]} for i in range(0, len(names), 3)]
    sync = WeightSync([synced], settings(secret_file, staging_bytes=64 << 10))
    out: dict = {"rank": dist.get_rank(), "sent": len(names)}
    try:
        out["wrote"] = staged_sync(
            (lambda: sync) if dist.get_rank() == 0 else None,
            lambda: sync.writer,
            pieces,
            version,
        )
    except WeightSyncError as err:
        out["error"] = str(err)
    finally:
        sync.close()
    out["staging_left"] = "weight_sync.staging" in host_memory.usage()
    full = gather_hf_weights(chunks, cfg)
    if full and "error" not in out:
        checkpoint = save_checkpoint(
            full, tiny_llama.hf_config(cfg), f"{out_dir}/ckpt_{version}", torch.bfloat16
        )
        EngineClient(reference).load_from_disk(checkpoint, version)
        out["checkpoint"] = str(checkpoint)
        out["bytes"] = sum(t.numel() * 2 for t in full.values())
    return out


def test_a_pp2_trainer_writes_each_stage_from_its_own_rank_and_commits_once(job, gloo_pool2):
    synced, reference = job["synced"], job["reference"]
    first, second = gloo_pool2.run(
        staged_task, {"pp": 2}, str(job["dir"]), job["secret"], synced.url, reference.url,
        "pp2-1",
    )  # fmt: skip
    assert "error" not in first and "error" not in second, (first, second)
    # each stage sent its own layers: nothing went through rank 0 but rank 0's stage
    assert first["wrote"] == first["sent"] and second["wrote"] == second["sent"]
    assert first["sent"] > 0 and second["sent"] > 0 and first["sent"] + second["sent"] == 21
    assert synced.client.weight_version() == "pp2-1"
    assert synced.client.generate(PROMPTS) == reference.client.generate(PROMPTS)
    job["last"] = {"checkpoint": first["checkpoint"], "bytes": first["bytes"]}


def test_a_stage_that_fails_fails_the_sync_on_every_rank_and_nothing_loads(job, gloo_pool2):
    serving = _serving(job)
    outs = gloo_pool2.run(
        staged_task, {"pp": 2}, str(job["dir"]), job["secret"], job["synced"].url,
        job["reference"].url, "pp2-bad", 1,
    )  # fmt: skip
    errors = {out["error"] for out in outs}
    assert len(errors) == 1, outs  # the same outcome on every rank
    (error,) = errors
    assert "has shape (3, 3)" in error and "(group rank 1)" in error, error
    assert _serving(job) == serving  # rank 0's stage landed but was never committed
    assert [out["staging_left"] for out in outs] == [False, False]


def _worker_env(secret_file: str) -> dict[str, str]:
    """Give this worker process the plugin's knobs as a framework's job has them (TCP on
    loopback, small staging); the environment before, to put back."""
    saved = dict(os.environ)
    os.environ.update(
        TITAN_WEIGHT_SYNC_SECRET_FILE=secret_file,
        TITAN_WEIGHT_SYNC_PROTOCOL="tcp",
        TITAN_WEIGHT_SYNC_HOST="127.0.0.1",
        TITAN_WEIGHT_SYNC_STAGING_BYTES="64KiB",
    )
    return saved


def _restore_last_checkpoint(job: dict, serving: tuple[str, list]) -> None:
    """Sync the last checkpoint back into the synced engine (the fault tests compare against
    what it serves)."""
    sync = WeightSync([job["synced"].url], settings(job["secret"]))
    sync.sync(_weights(job), "restored")
    sync.close()
    assert job["synced"].client.generate(PROMPTS) == serving[1]


class SlimeShapedUpdater:
    """What ``slime_update.send_weights`` uses of slime's ``UpdateWeightFromDistributed`` (CI
    has no slime checkout; the opt-in test below runs slime's own class): its bucket iterators
    (here this rank's Hugging Face weights, three tensors a bucket, on the stage's source rank),
    ``_on_chunk``, ``_is_pp_src_rank``, ``weight_version`` and the engines."""

    def __init__(self, dense: dict, source: bool, urls: list[str], version: int) -> None:
        self.dense, self._is_pp_src_rank = dense, source
        self.rollout_engines, self.weight_version = urls, version
        self.chunks_seen = 0

    def _iter_non_expert_chunks(self):
        names = sorted(self.dense) if self._is_pp_src_rank else []
        for i in range(0, len(names), 3):
            yield [(n, self.dense[n]) for n in names[i : i + 3]]

    def _iter_expert_chunks(self):
        return iter(())

    def _on_chunk(self, chunk) -> None:
        self.chunks_seen += 1


def slime_shaped_task(layout: dict, synced: str, secret_file: str, version: int) -> dict:
    """``send_weights`` on every rank of a PP=2 trainer, slime's gloo group being the world and
    the engine URLs given; ``original`` (slime's broadcast) only records that it ran."""
    from megatron.core import parallel_state as ps
    from titan_weight_sync import slime_update
    from titan_weight_sync.megatron_export import local_hf_weights

    tiny_gpt.init_parallel(**layout)
    cfg = tiny_llama.make_config()
    chunks = tiny_llama.build(cfg)
    dense, _ = local_hf_weights(chunks, cfg)
    source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    updater = SlimeShapedUpdater(dense, source, [synced], version)
    ran: list[str] = []
    saved = _worker_env(secret_file)
    group, urls = slime_update._group, slime_update._engine_urls
    slime_update._group = lambda: None  # slime's gloo group spans every rank: the world here
    slime_update._engine_urls = lambda u: list(u.rollout_engines)
    before = stats.snapshot().get("fallbacks", 0)
    try:
        slime_update.send_weights(lambda u, pbar: ran.append("slime"), updater, None)
    finally:
        slime_update._group, slime_update._engine_urls = group, urls
        os.environ.clear()
        os.environ.update(saved)
        for held in ("_titan_weight_sync", "_titan_weight_sync_writer"):
            if getattr(updater, held, None) is not None:
                getattr(updater, held).close()
    return {
        "slime_ran": ran,
        "fallbacks": stats.snapshot().get("fallbacks", 0) - before,
        "chunks": updater.chunks_seen,
        "tensors": len(dense) if source else 0,
    }


def test_slimes_send_weights_goes_through_weight_sync_or_falls_back_on_every_rank(
    job, gloo_pool2, tmp_path
) -> None:
    synced = job["synced"]
    serving = _serving(job)
    # an engine that refuses the trainer (another job's secret): slime's broadcast runs everywhere
    other = str(tmp_path / "other-secret")
    auth.write_secret(other)
    outs = gloo_pool2.run(slime_shaped_task, {"pp": 2}, synced.url, other, 7)
    assert [o["slime_ran"] for o in outs] == [["slime"], ["slime"]], outs
    assert [o["fallbacks"] for o in outs] == [1, 1]
    assert [o["chunks"] for o in outs] == [0, 0]  # nothing consumed: slime's pass starts clean
    assert _serving(job) == serving
    # the job's secret: every stage writes its buckets, slime's broadcast never runs
    outs = gloo_pool2.run(slime_shaped_task, {"pp": 2}, synced.url, job["secret"], 8)
    assert [o["slime_ran"] for o in outs] == [[], []], outs
    assert [o["fallbacks"] for o in outs] == [0, 0]
    assert all(o["chunks"] == -(-o["tensors"] // 3) and o["chunks"] > 0 for o in outs), outs
    assert synced.client.weight_version() == "8"
    assert synced.client.generate(PROMPTS) != serving[1]
    _restore_last_checkpoint(job, serving)


class MilesShapedUpdater:
    """What ``miles_update.update_weights`` uses of miles' ``DistBucketedWeightUpdateMixin``
    (CI has no miles checkout; the opt-in test runs miles' own class): its two bucketed passes
    (here this rank's Hugging Face weights, three tensors a bucket, handed to the callback on
    the stage's source rank as miles' ``_is_source`` does), ``weight_version``, ``args``,
    ``is_lora`` and the engines."""

    def __init__(self, dense: dict, source: bool, urls: list[str], version: int, mode: str):
        self.dense, self._is_source = dense, source
        self.rollout_engines, self.weight_version = urls, version
        self.args = argparse.Namespace(pause_generation_mode=mode)
        self.is_lora = False
        self.buckets_seen = 0

    def _gather_and_update_non_expert_weights(self, update_bucket_weight_func, pbar=None):
        names = sorted(self.dense) if self._is_source else []
        for i in range(0, len(names), 3):
            self.buckets_seen += 1
            update_bucket_weight_func([(n, self.dense[n]) for n in names[i : i + 3]], pbar)

    def _gather_and_update_expert_weights(self, update_bucket_weight_func, pbar=None):
        pass  # a dense model: miles' expert pass hands over nothing


def miles_shaped_task(layout: dict, synced: str, secret_file: str, version: int, mode: str) -> dict:
    """miles' ``update_weights`` through ``miles_update`` on every rank of a PP=2 trainer,
    miles' gloo group being the world; ``original`` (miles' own update) records that it ran and
    counts the version, as miles' does."""
    from megatron.core import parallel_state as ps
    from titan_weight_sync import held, miles_update
    from titan_weight_sync.megatron_export import local_hf_weights

    tiny_gpt.init_parallel(**layout)
    cfg = tiny_llama.make_config()
    chunks = tiny_llama.build(cfg)
    dense, _ = local_hf_weights(chunks, cfg)
    source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    updater = MilesShapedUpdater(dense, source, [synced], version, mode)
    ran: list[str] = []

    def miles_own(u) -> None:
        u.weight_version += 1
        ran.append("miles")

    saved = _worker_env(secret_file)
    stand_ins = {  # miles' own lookups, each given what miles would answer here
        "_group": lambda: None,  # miles' gloo group spans every rank: the world here
        "_engine_urls": lambda u: list(u.rollout_engines),
        "_is_stage_writer": lambda: source,
        "_session": lambda u: {"pause_mode": u.args.pause_generation_mode, "selector": "all"},
    }
    originals = {name: getattr(miles_update, name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        setattr(miles_update, name, stand_in)
    before = stats.snapshot().get("fallbacks", 0)
    try:
        miles_update.update_weights(miles_own, updater)
    finally:
        for name, original in originals.items():
            setattr(miles_update, name, original)
        os.environ.clear()
        os.environ.update(saved)
        held.release(updater)
    return {
        "miles_ran": ran,
        "fallbacks": stats.snapshot().get("fallbacks", 0) - before,
        "buckets": updater.buckets_seen,
        "tensors": len(dense) if source else 0,
        "version": updater.weight_version,
    }


def test_miles_update_goes_through_weight_sync_or_falls_back_on_every_rank(
    job, gloo_pool2, tmp_path
) -> None:
    synced = job["synced"]
    serving = _serving(job)
    # an engine that refuses the trainer: miles' own update runs everywhere, counting once
    other = str(tmp_path / "other-secret")
    auth.write_secret(other)
    outs = gloo_pool2.run(miles_shaped_task, {"pp": 2}, synced.url, other, 7, "retract")
    assert [o["miles_ran"] for o in outs] == [["miles"], ["miles"]], outs
    assert [o["fallbacks"] for o in outs] == [1, 1]
    assert [o["buckets"] for o in outs] == [0, 0]  # nothing consumed: miles' passes start clean
    assert [o["version"] for o in outs] == [8, 8]
    assert _serving(job) == serving
    # the job's secret, miles paused in place: every stage writes, miles' own never runs
    outs = gloo_pool2.run(miles_shaped_task, {"pp": 2}, synced.url, job["secret"], 8, "in_place")
    assert [o["miles_ran"] for o in outs] == [[], []], outs
    assert [o["fallbacks"] for o in outs] == [0, 0]
    assert all(o["buckets"] == -(-o["tensors"] // 3) and o["buckets"] > 0 for o in outs), outs
    assert [o["version"] for o in outs] == [9, 9]
    assert synced.client.weight_version() == "9"
    assert synced.client.generate(PROMPTS) != serving[1]
    _restore_last_checkpoint(job, serving)


def run_framework_job(
    job: dict, framework: str, env_extra: dict, layout: dict, out: Path
) -> list[dict]:
    """``<framework>_job.py`` under torchrun on 2 ranks, the plugin activated the way a user's
    job has it; checks what every framework's run must show (two updates, each bit-identical to
    a disk-loaded engine, no fallback, the whole model sent by the stages' source ranks) and
    returns the records of the two updates."""
    spec = {
        **layout,
        "synced": job["synced"].url,
        "reference": job["reference"].url,
        "out": str(out),
        "updates": 2,
        "buffer_bytes": 64 << 10,  # the framework's buckets: several per stage
        "prompts": PROMPTS,
    }
    env = {
        **os.environ,
        **env_extra,
        "TITAN_PLUGINS_ONLY": "weight_sync",
        "TITAN_PLUGINS_STRICT": "1",
        "TITAN_WEIGHT_SYNC_SECRET_FILE": job["secret"],
        "TITAN_WEIGHT_SYNC_PROTOCOL": "tcp",
        "TITAN_WEIGHT_SYNC_HOST": "127.0.0.1",
        "TITAN_WEIGHT_SYNC_STAGING_BYTES": "64KiB",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("TITAN_PLUGINS_AUTOLOAD", None)  # the automatic channel, as in a user's job
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()),
         str(Path(__file__).with_name(f"{framework}_job.py")), json.dumps(spec)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not line:
        first_error = done.stderr[done.stderr.find("Traceback") :][:6000]
        pytest.fail(f"the {framework} job failed (exit {done.returncode}):\n{first_error}")
    result = json.loads(line[0][len("RESULT ") :])
    found, stats_by_rank = result["records"], result["stats"]
    assert [r["version"] for r in found] == ["1", "2"]
    for record in found:
        assert record["synced"] == record["reference"], record["version"]
    assert found[0]["synced"] != found[1]["synced"]
    assert all(s.get("fallbacks", 0) == 0 for s in stats_by_rank), stats_by_rank
    sent = [s.get(f"{framework}_tensors_sent", 0) for s in stats_by_rank]
    assert sum(sent) == 2 * 21, sent  # the whole model, each update
    if layout["pp"] == 2:
        assert sent[0] > 0 and sent[1] > 0, sent  # each stage sent its own layers
    else:
        assert sent[1] == 0, sent  # tensor-parallel rank 1 only joined the gathers
    job["last"] = {"checkpoint": str(Path(out) / f"{framework}_2")}  # what the engine serves
    return found


SLIME_DIR = os.environ.get("SLIME_DIR", "")


@pytest.mark.skipif(
    not SLIME_DIR,
    reason="opt-in: SLIME_DIR=<a THUDM/slime checkout>, with slime's tqdm and httpx importable "
    "(the command is in docs/hosts.md)",
)
@pytest.mark.parametrize("layout", [{"tp": 2, "pp": 1}, {"tp": 1, "pp": 2}], ids=["tp2", "pp2"])
def test_slimes_own_update_path_sends_through_weight_sync(job, layout, tmp_path) -> None:
    """slime's real ``UpdateWeightFromDistributed.update_weights`` (its gathers, its
    ``convert_to_hf``) under torchrun, with the plugin activated the way a user's job has it."""
    run_framework_job(job, "slime", {"SLIME_DIR": SLIME_DIR}, layout, tmp_path)


MILES_DIR = os.environ.get("MILES_DIR", "")


@pytest.mark.skipif(
    not MILES_DIR,
    reason="opt-in: MILES_DIR=<a radixark/miles checkout>, with miles' tqdm importable and "
    "MILES_SGLANG_SITE=<the SGLang venv's site-packages> (the command is in docs/hosts.md)",
)
@pytest.mark.parametrize(
    "layout",
    [
        {"tp": 2, "pp": 1, "mode": "retract", "updater": "broadcast"},
        {"tp": 1, "pp": 2, "mode": "in_place", "updater": "broadcast"},
        {"tp": 2, "pp": 1, "mode": "retract", "updater": "p2p"},
    ],
    ids=["tp2-retract", "pp2-in_place", "p2p-tp2-retract"],
)
def test_miles_own_update_path_sends_through_weight_sync(job, layout, tmp_path) -> None:
    """miles' real ``update_weights`` of ``UpdateWeightFromDistributed`` and of
    ``UpdateWeightP2P`` (their passes, gathers and ``convert_to_hf``) under torchrun, with the
    plugin activated the way a user's job has it."""
    spec = {
        "tp": layout["tp"], "pp": layout["pp"], "pause_mode": layout["mode"],
        "updater": layout["updater"],
    }  # fmt: skip
    records = run_framework_job(job, "miles", {"MILES_DIR": MILES_DIR}, spec, tmp_path)
    assert [r["updater_version"] for r in records] == [1, 2]
    kind = {"broadcast": "UpdateWeightFromDistributed", "p2p": "UpdateWeightP2P"}
    assert {r["updater_class"] for r in records} == {kind[layout["updater"]]}


@pytest.fixture(scope="module")
def moe_job(job, gloo_pool1):
    """Two engines serving the Mixtral-style checkpoint of the tiny MoE GPT (its initial
    weights); the secret is the dense job's."""
    out = job["dir"]
    gloo_pool1.run(initial_checkpoint_task, str(out), "moe_", True)
    env = {"TITAN_WEIGHT_SYNC_SECRET_FILE": job["secret"]}
    engines = [CPUEngine(out / "moe_ckpt0", out / f"moe_{n}.log", env) for n in ("synced", "ref")]
    try:
        for engine in engines:
            engine.wait_ready()
        yield {"synced": engines[0], "reference": engines[1]}
    finally:
        for engine in engines:
            engine.stop()


def test_a_moe_model_from_an_ep2_trainer_matches_a_disk_loaded_engine_and_transformers(
    job, moe_job, gloo_pool2
) -> None:
    synced, reference = moe_job["synced"], moe_job["reference"]
    before = synced.client.generate(PROMPTS)
    records, rest = gloo_pool2.run(
        train_and_sync_task, {"ep": 2}, str(job["dir"]), job["secret"], synced.url,
        reference.url, ["moe-1", "moe-2"], True,
    )  # fmt: skip
    assert rest == []
    assert [r["synced_version"] for r in records] == ["moe-1", "moe-2"]
    assert records[0]["synced"] != before
    for record in records:
        assert record["synced"] == record["reference"], record["version"]
    hf = hf_reference(job["dir"], [r["checkpoint"] for r in records], prefix="moe_")
    for record in records:
        tokens = [row["tokens"] for row in record["synced"]]
        assert tokens == hf["greedy"][record["checkpoint"]], record["version"]
    # megatron's MoE forward (router top-2, experts) equals Mixtral's on the converted weights
    assert hf["logits_max_diff"] < 1e-5 * max(1.0, hf["logits_scale"]), hf


# ---------------------------------------------------------------- an engine with tp_size 2
@pytest.fixture(scope="module")
def tp2_engine(job):
    """An engine with two TP ranks (two scheduler processes, each its own shard), serving the
    initial checkpoint; SGLang on CPU needs a core list per rank."""
    cores = f"0|{min(1, (os.cpu_count() or 1) - 1)}"
    env = {"TITAN_WEIGHT_SYNC_SECRET_FILE": job["secret"], "SGLANG_CPU_OMP_THREADS_BIND": cores}
    engine = CPUEngine(job["dir"] / "ckpt0", job["dir"] / "tp2.log", env, ("--tp-size", "2"))
    try:
        yield engine.wait_ready()
    finally:
        engine.stop()


def test_a_tp2_engine_loads_every_rank_and_matches_itself_loaded_from_disk(job, tp2_engine):
    """Rank 0 takes the write and the checks, each rank loads its own shard: after each of two
    syncs the engine's logprobs are bit-identical to the same engine loaded from disk; a
    forged write is refused on every rank, and the engine goes on serving."""
    client = tp2_engine.client
    initial = client.generate(PROMPTS)
    ckpt0 = job["dir"] / "ckpt0"
    weights0 = load_safetensors(ckpt0 / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    weights1 = {
        name: (t.float() + 0.02 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in weights0.items()
    }
    config = json.loads((ckpt0 / "config.json").read_text())
    ckpt1 = save_checkpoint(weights1, config, job["dir"] / "tp2_ckpt1", torch.bfloat16)
    sync = WeightSync([tp2_engine.url], settings(job["secret"], staging_bytes=64 << 10))
    try:
        sync.sync(load_safetensors(ckpt1 / "model.safetensors"), "tp2-a")
        assert client.weight_version() == "tp2-a"
        synced = client.generate(PROMPTS)
        assert synced != initial, "the update changed nothing the engine serves"
        client.load_from_disk(ckpt1, "disk-a")
        assert client.generate(PROMPTS) == synced  # bit-identical logprobs, both ranks' shards
        sync.sync(weights0, "tp2-b")
        assert client.weight_version() == "tp2-b"
        assert client.generate(PROMPTS) == initial  # the initial checkpoint, loaded from disk
        sync.writer = _ForgedInBetween(sync.settings)
        with pytest.raises(WeightSyncError, match="differ from what the trainer wrote"):
            sync.sync(weights1, "tp2-forged")
    finally:
        sync.close()
    assert client.weight_version() == "tp2-b" and client.generate(PROMPTS) == initial


# ---------------------------------------------------------------- faults
def _serving(job) -> tuple[str, list]:
    client = job["synced"].client
    return client.weight_version(), client.generate(PROMPTS)


def _checkpoint(job) -> Path:
    """The last checkpoint synced (the initial one when this test runs alone)."""
    last = job.get("last")
    return Path(last["checkpoint"] if last else job["dir"] / "ckpt0") / "model.safetensors"


def _weights(job) -> dict[str, torch.Tensor]:
    return load_safetensors(_checkpoint(job))


def test_bad_input_is_refused_by_name_before_a_byte_moves(job, monkeypatch) -> None:
    serving = _serving(job)
    weights = _weights(job)
    sync = WeightSync([job["synced"].url], settings(job["secret"]))
    cases = {
        "model.layers.9.mlp.up_proj.weight": ("serve no tensor named", lambda w: w.update(
            {"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})),
        "shape": (r"has shape \(64, 63\)", lambda w: w.update(
            {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 63)})),
        "missing": ("were not given", lambda w: w.pop("model.norm.weight")),
    }  # fmt: skip
    for what, (message, change) in cases.items():
        broken = dict(weights)
        change(broken)
        with pytest.raises(WeightSyncError, match=message):
            sync.sync(broken, f"bad-{what}")
    # the staging budget: refused by the host-memory ledger, naming both knobs
    monkeypatch.setenv("TITAN_PLUGINS_MAX_HOST_BYTES", "1MiB")
    small = WeightSync([job["synced"].url], settings(job["secret"], staging_bytes=64 << 20))
    with pytest.raises(WeightSyncError, match="TITAN_WEIGHT_SYNC_STAGING_BYTES.*TITAN_PLUGINS_MAX"):
        small.sync(weights, "bad-staging")
    small.close()
    monkeypatch.delenv("TITAN_PLUGINS_MAX_HOST_BYTES")
    sync.close()
    assert "weight_sync.staging" not in host_memory.usage()
    assert _serving(job) == serving


def test_a_peer_without_the_secret_learns_nothing(job) -> None:
    api = job["synced"].api
    ok, text = api.titan(wire.hello_request(bytes(32), "0" * 32))
    assert not ok and "not signed with the job's secret" in text
    assert "session_id" not in text and "landing" not in text


def test_replayed_and_forged_commits_are_refused(job, monkeypatch) -> None:
    from titan_weight_sync.engine_api import EngineAPI

    sent: list[bytes] = []
    original = EngineAPI.titan

    def recording(self, payload, weight_version=None, flush_cache=True):
        sent.append(payload)
        return original(self, payload, weight_version, flush_cache)

    monkeypatch.setattr(EngineAPI, "titan", recording)
    sync = WeightSync([job["synced"].url], settings(job["secret"]))
    sync.sync(_weights(job), "replay-base")
    sync.close()
    monkeypatch.setattr(EngineAPI, "titan", original)
    serving = _serving(job)
    commit = next(p for p in sent if b'"op":"commit"' in p)
    api = job["synced"].api
    ok, text = api.titan(commit, "replayed")
    assert not ok and "commit without a hello" in text
    secret = auth.read_secret(job["secret"], "secret")
    ok, hello = api.titan(wire.hello_request(secret, auth.nonce()))
    assert ok
    ok, text = api.titan(commit, "replayed")  # a new exchange is open: still not this one's
    assert not ok and "another exchange" in text
    ok, hello = api.titan(wire.hello_request(secret, auth.nonce()))
    nonce = wire.reply_body(hello)["engine_nonce"]
    forged = wire.commit_request(bytes(32), nonce, "forged", [("a", "0" * 64)])
    ok, text = api.titan(forged, "forged")
    assert not ok and "not signed" in text
    ok, _ = api.titan(wire.abort_request(secret, nonce))
    assert ok
    assert _serving(job) == serving


def test_a_commit_while_the_engine_serves_is_refused_and_nothing_loads(job) -> None:
    """A signed, complete commit sent without SGLang's session (0.5.23) or without pausing
    generation (0.5.15.post1, which has no session) is refused with that reason."""
    serving = _serving(job)
    weights = _weights(job)
    sync = WeightSync([job["synced"].url], settings(job["secret"]))
    try:
        landings = sync.open()
        digests = sync.writer.write(landings, weights)
        target = sync._open[0]
        assert target.session == job["synced"].client.has_session()  # the hello told the trainer
        secret = auth.read_secret(job["secret"], "secret")
        ordered = [(slot.name, digests[slot.name]) for slot in target.slots]
        ok, text = target.api.titan(wire.commit_request(secret, target.nonce, "early", ordered))
        target.nonce = ""  # the engine closed the exchange
    finally:
        sync.abort()
        sync.close()
    why = "no weight-update session is open" if target.session else "generation is not paused"
    assert not ok and why in text, text
    assert _serving(job) == serving


FORGER = textwrap.dedent(
    """
    import sys, torch
    from mooncake.engine import TransferEngine
    session, addr = sys.argv[1], int(sys.argv[2])
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    junk = torch.full((64,), 0x3F, dtype=torch.uint8)
    assert te.register_memory(junk.data_ptr(), 64) == 0
    print(te.batch_transfer_sync_write(session, [junk.data_ptr()], [addr], [64]))
    """
)


class _ForgedInBetween(LandingWriter):
    """A third process writes into the engine's landing region after the trainer's writes."""

    def write(self, landings, weights):
        found = super().write(landings, weights)
        target = landings.engines[0]
        done = subprocess.run(
            [sys.executable, "-c", FORGER, target.session_id, str(target.addr)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.stdout.strip().endswith("0"), done.stderr[-2000:]  # the forged write landed
        return found


def test_a_write_from_a_third_process_is_caught_and_nothing_loads(job) -> None:
    serving = _serving(job)
    sync = WeightSync([job["synced"].url], settings(job["secret"]))
    sync.writer = _ForgedInBetween(sync.settings)
    with pytest.raises(WeightSyncError, match="differ from what the trainer wrote"):
        sync.sync(_weights(job), "forged-write")
    sync.close()
    assert _serving(job) == serving
    assert "weight_sync.staging" not in host_memory.usage()


TRAINER_DIES = textwrap.dedent(
    """
    import os, sys
    from titan_weight_sync.hf_checkpoint import load_safetensors
    from titan_weight_sync.settings import WeightSyncSettings
    from titan_weight_sync.trainer_side import WeightSync

    url, secret, checkpoint = sys.argv[1:4]
    weights = load_safetensors(checkpoint)
    settings = WeightSyncSettings(protocol="tcp", host="127.0.0.1", secret_file=secret,
                                  staging_bytes=64 << 10)
    sync = WeightSync([url], settings)
    engine, _ = sync.writer._staging_buffer()
    write = engine.write
    def write_once(*args):
        write(*args)
        os._exit(9)  # killed after the first piece landed
    engine.write = write_once
    sync.sync(weights, "never")
    """
)


def test_a_trainer_killed_mid_sync_leaves_the_engine_serving(job) -> None:
    serving = _serving(job)
    checkpoint = str(_checkpoint(job))
    done = subprocess.run(
        [sys.executable, "-c", TRAINER_DIES, job["synced"].url, job["secret"], checkpoint],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 9, done.stderr[-3000:]
    assert _serving(job) == serving
    # the next trainer finds the engine as usual
    sync = WeightSync([job["synced"].url], settings(job["secret"]))
    sync.sync(_weights(job), "after-the-crash")
    sync.close()
    assert job["synced"].client.weight_version() == "after-the-crash"
    assert job["synced"].client.generate(PROMPTS) == serving[1]  # the same weights again


def test_an_engine_killed_mid_sync_fails_the_sync_by_name_and_nothing_leaks(job) -> None:
    sync = WeightSync([job["synced"].url], settings(job["secret"], staging_bytes=64 << 10))
    mooncake, _ = sync.writer._staging_buffer()
    write = mooncake.write

    def write_then_kill(*args):  # the engine dies after the first piece of the writes
        write(*args)
        job["synced"].stop()

    mooncake.write = write_then_kill
    before = stats.snapshot().get("failed_syncs", 0)
    with pytest.raises(WeightSyncError, match=f"writing to the engine at {job['synced'].url}"):
        sync.sync(_weights(job), "engine-dies")
    assert stats.snapshot()["failed_syncs"] == before + 1
    assert mooncake.registered_regions() == 1  # the staging
    sync.close()
    assert mooncake.registered_regions() == 0
    assert "weight_sync.staging" not in host_memory.usage()
