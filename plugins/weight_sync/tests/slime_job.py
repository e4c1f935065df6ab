"""A slime training job's weight update, run on CPU by torchrun against a slime checkout.

Run by ``test_weight_sync_slime.py`` (opt-in: ``SLIME_DIR``) as a user's job meets the plugin:
the core activates through its automatic channel, and the patch lands on slime's own
``UpdateWeightFromDistributed`` when slime's module is imported. Each rank trains the tiny
Llama-style GPT with megatron-core's own schedules (gloo), then slime's real
``update_weights()`` runs: global rank 0 pauses and flushes the engines through their Ray
handles, slime's iterators gather and convert the weights (slime's ``convert_to_hf``), and
weight_sync sends them from every pipeline stage's source rank.

What stands in for slime's driver, and why:

- ``EngineHandle`` is a Ray actor with the methods of slime's ``SGLangEngine`` that this path
  calls, each the same HTTP request (slime's class imports SGLang, which the trainer venv lacks).
- ``TENames``: slime's converters know TransformerEngine's names, where the attention's input
  norm is fused into ``linear_qkv`` (``layer_norm_weight``); CPU has no TE, so the local spec's
  ``input_layernorm.weight`` is shown under that name (the same tensor).
- the core's CPU harness answers megatron's CUDA-only calls, as in every CPU test;
- slime's ``connect_rollout_engines`` is not called: it builds slime's NCCL broadcast group,
  which this path does not use. Its attributes are set as it sets them.

Usage: torchrun --nproc-per-node N slime_job.py JOB_JSON  (prints ``RESULT {...}`` on rank 0)
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace

import torch
import torch.distributed as dist


class TENames:
    """A megatron model chunk as slime sees a TransformerEngine-spec one (same tensors)."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        self.chunk = chunk
        self.config = chunk.config

    def named_parameters(self, *args, **kwargs):
        for name, param in self.chunk.named_parameters(*args, **kwargs):
            yield (
                name.replace(
                    ".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"
                ),
                param,
            )

    def named_buffers(self, *args, **kwargs):
        return self.chunk.named_buffers(*args, **kwargs)


def engine_handle_class():
    """The Ray actor standing in for slime's ``SGLangEngine`` (its HTTP requests)."""
    import ray
    from titan_weight_sync.engine_api import EngineAPI

    @ray.remote(num_cpus=0)
    class EngineHandle:
        def __init__(self, url: str) -> None:
            self.url = url
            self.api = EngineAPI(url, 120.0)

        def get_url(self) -> str:
            return self.url

        def pause_generation(self) -> None:
            self.api.require("/pause_generation", {})

        def flush_cache(self) -> None:
            self.api.require("/flush_cache")

        def continue_generation(self) -> None:
            self.api.require("/continue_generation", {})

    return EngineHandle


def main() -> None:
    job = json.loads(sys.argv[1])
    sys.path.insert(0, os.environ["SLIME_DIR"])
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()  # megatron's CUDA-only calls (RNG tracker, streams) on CPU
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )
    from titan_weight_sync import stats, tiny_llama
    from titan_weight_sync.cpu_engine import EngineClient
    from titan_weight_sync.hf_checkpoint import save_checkpoint
    from titan_weight_sync.megatron_export import gather_hf_weights

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel(tp=job["tp"], pp=job["pp"])
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed import (
        UpdateWeightFromDistributed,
    )
    from slime.utils.distributed_utils import init_gloo_group

    init_gloo_group()
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
        q_lora_rank=None,
        num_experts=None,
        update_weight_buffer_size=job["buffer_bytes"],
    )
    updater = UpdateWeightFromDistributed(
        args, [TENames(c) for c in chunks], None, model_name="llama", quantization_config=None
    )
    # what slime's connect_rollout_engines sets (without its NCCL group)
    updater._is_pp_src_rank = (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )
    updater._group_name = f"slime-pp_{ps.get_pipeline_model_parallel_rank()}"
    updater.rollout_engines = []
    if rank == 0:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        handle = engine_handle_class()
        updater.rollout_engines = [handle.remote(job["synced"])]

    records = []
    for version in range(1, job["updates"] + 1):
        tiny_gpt.train(chunks, cfg, steps=2, optimizer=optimizer)
        updater.update_weights()  # slime's own, patched by weight_sync
        full = gather_hf_weights(chunks, cfg)
        if rank == 0:
            checkpoint = save_checkpoint(
                full, tiny_llama.hf_config(cfg), f"{job['out']}/slime_{version}", torch.bfloat16
            )
            EngineClient(job["reference"]).load_from_disk(checkpoint, str(version))
            records.append(
                {
                    "version": EngineClient(job["synced"]).weight_version(),
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
