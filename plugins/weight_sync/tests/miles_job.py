"""A miles training job's weight update, run on CPU by torchrun against a miles checkout.

Run by ``test_weight_sync_engine.py`` (opt-in: ``MILES_DIR``) as a user's job meets the plugin:
the core activates through its automatic channel, and the patch lands on miles' own
``DistBucketedWeightUpdateMixin.update_weights`` when miles' module is imported. Each rank trains
the tiny Llama-style GPT with megatron-core's own schedules (gloo), then miles' real
``UpdateWeightFromDistributed.update_weights()`` runs: miles' passes gather every tensor-parallel
weight and convert it with miles' ``convert_to_hf``, and weight_sync sends the buckets from every
pipeline stage's source rank and commits once on rank 0.

What stands in for miles' driver, and why:

- ``EngineHandle`` is a Ray actor with the one method of miles' ``SGLangEngine`` this path calls
  (``get_topology_info``, for the engine's URL);
- miles' ``ParallelState`` is built from megatron's ``parallel_state`` as miles'
  ``create_megatron_parallel_state`` builds it (that function reads ``megatron.training``'s
  global args, which a megatron-core wheel does not ship);
- ``TENames`` (from ``slime_job.py``): miles' converters, like slime's, know TransformerEngine's
  names;
- the core's CPU harness answers megatron's CUDA-only calls, as in every CPU test;
- SGLang is importable in the trainer (miles' conversion imports it): the SGLang venv's
  site-packages are appended after the trainer's own (``MILES_SGLANG_SITE``);
- miles' ``connect_rollout_engines`` is not called: it builds miles' NCCL broadcast group,
  which this path does not use.

Usage: torchrun --nproc-per-node N miles_job.py JOB_JSON  (prints ``RESULT {...}`` on rank 0)
"""

from __future__ import annotations

import json
import os
import site
import sys
from argparse import Namespace

import torch
import torch.distributed as dist
from slime_job import TENames


def engine_handle_class():
    """The Ray actor standing in for miles' ``SGLangEngine`` (what this path asks of it)."""
    import ray

    @ray.remote(num_cpus=0)
    class EngineHandle:
        def __init__(self, url: str) -> None:
            self.url = url

        def get_topology_info(self) -> dict:
            return {"url": self.url, "gpu_ids": []}

    return EngineHandle


def miles_parallel_state() -> None:
    """miles' ``ParallelState`` from megatron's groups (as ``create_megatron_parallel_state``)."""
    from megatron.core import parallel_state as mpu
    from miles.backends.training_utils.parallel import ParallelState, set_parallel_state
    from miles.utils.ft_utils.process_group_utils import GroupInfo

    def dp(with_cp: bool) -> GroupInfo:
        return GroupInfo(
            rank=mpu.get_data_parallel_rank(with_context_parallel=with_cp),
            size=mpu.get_data_parallel_world_size(with_context_parallel=with_cp),
            group=mpu.get_data_parallel_group(with_context_parallel=with_cp),
        )

    set_parallel_state(
        ParallelState(
            intra_dp=dp(False),
            intra_dp_cp=dp(True),
            cp=GroupInfo(rank=0, size=1, group=mpu.get_context_parallel_group()),
            tp=GroupInfo(
                rank=mpu.get_tensor_model_parallel_rank(),
                size=mpu.get_tensor_model_parallel_world_size(),
                group=mpu.get_tensor_model_parallel_group(),
            ),
            pp=GroupInfo(
                rank=mpu.get_pipeline_model_parallel_rank(),
                size=mpu.get_pipeline_model_parallel_world_size(),
                group=mpu.get_pipeline_model_parallel_group(),
            ),
            ep=GroupInfo(
                rank=mpu.get_expert_model_parallel_rank(),
                size=mpu.get_expert_model_parallel_world_size(),
                group=mpu.get_expert_model_parallel_group(),
            ),
            etp=GroupInfo(
                rank=mpu.get_expert_tensor_parallel_rank(),
                size=mpu.get_expert_tensor_parallel_world_size(),
                group=mpu.get_expert_tensor_parallel_group(),
            ),
            indep_dp=GroupInfo(rank=0, size=1, group=None),
            is_pp_last_stage=mpu.is_pipeline_last_stage(),
        )
    )


def main() -> None:
    job = json.loads(sys.argv[1])
    sys.path.insert(0, os.environ["MILES_DIR"])
    if os.environ.get("MILES_SGLANG_SITE"):
        site.addsitedir(os.environ["MILES_SGLANG_SITE"])  # after the trainer's own packages
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()  # megatron's CUDA-only calls (RNG tracker, streams) on CPU
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )
    from titan_weight_sync import stats, tiny_llama
    from titan_weight_sync.cpu_engine import EngineClient
    from titan_weight_sync.hf_checkpoint import save_checkpoint
    from titan_weight_sync.megatron_export import gather_hf_weights

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel(tp=job["tp"], pp=job["pp"])
    from miles.backends.megatron_utils.update_weight.update_weight_from_distributed.broadcast import (  # noqa: E501
        UpdateWeightFromDistributed,
    )
    from miles.utils.distributed_utils import init_gloo_group

    init_gloo_group()
    miles_parallel_state()
    cfg = tiny_llama.make_config()
    chunks = tiny_llama.build(cfg)
    for chunk in chunks:  # as megatron.training's get_model does
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    optimizer = tiny_gpt.make_optimizer(chunks, cfg, lr=3e-3)

    args = Namespace(
        vocab_size=tiny_gpt.VOCAB,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        swiglu=True,
        q_lora_rank=None,
        num_experts=None,
        update_weight_buffer_size=job["buffer_bytes"],
        pause_generation_mode=job["pause_mode"],
        megatron_to_hf_mode="raw",
    )
    updater = UpdateWeightFromDistributed(
        args, [TENames(c) for c in chunks], None, model_name="llama", quantization_config=None
    )
    updater.rollout_engines = []
    if rank == 0:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        updater.rollout_engines = [engine_handle_class().remote(job["synced"])]

    records = []
    for version in range(1, job["updates"] + 1):
        tiny_gpt.train(chunks, cfg, steps=2, optimizer=optimizer)
        updater.update_weights()  # miles' own, patched by weight_sync
        full = gather_hf_weights(chunks, cfg)
        if rank == 0:
            checkpoint = save_checkpoint(
                full, tiny_llama.hf_config(cfg), f"{job['out']}/miles_{version}", torch.bfloat16
            )
            EngineClient(job["reference"]).load_from_disk(checkpoint, str(version))
            records.append(
                {
                    "version": EngineClient(job["synced"]).weight_version(),
                    "updater_version": updater.weight_version,
                    "synced": EngineClient(job["synced"]).generate(job["prompts"]),
                    "reference": EngineClient(job["reference"]).generate(job["prompts"]),
                }
            )
    sent = [None] * dist.get_world_size()
    dist.all_gather_object(sent, stats.snapshot())
    if rank == 0:
        print("RESULT " + json.dumps({"records": records, "stats": sent}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
