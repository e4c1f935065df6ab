"""What ``slime_job.py`` and ``miles_job.py`` share: a tiny Llama-style GPT trained by
megatron-core's own schedules on gloo ranks, the arguments both frameworks' converters read, the
TransformerEngine names they know, and the loop that trains, runs the framework's own
``update_weights()`` and compares the synced engine with one loaded from disk."""

from __future__ import annotations

import json
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class TENames:
    """A megatron model chunk as slime and miles see a TransformerEngine-spec one (same
    tensors): their converters know TE's names, where the attention's input norm is fused into
    ``linear_qkv`` (``layer_norm_weight``); CPU has no TE, so the local spec's
    ``input_layernorm.weight`` is shown under that name."""

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


@dataclass
class Trainer:
    """One rank's model, its config and its optimizer."""

    rank: int
    chunks: list
    cfg: Any
    optimizer: Any


def start(job: dict, framework_groups: Callable[[], None]) -> Trainer:
    """The CPU harness, gloo, megatron's parallel state (``job``'s tp / pp), the framework's own
    groups (``framework_groups``, after megatron's), then the model and its optimizer."""
    from titan_plugins.hosts.megatron.testing import cpu_harness

    cpu_harness.install()  # megatron's CUDA-only calls (RNG tracker, streams) on CPU
    dist.init_process_group("gloo")
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )
    from titan_weight_sync import tiny_llama

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    tiny_gpt.init_parallel(tp=job["tp"], pp=job["pp"])
    framework_groups()
    cfg = tiny_llama.make_config()
    chunks = tiny_llama.build(cfg)
    for chunk in chunks:  # as megatron.training's get_model does
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    optimizer = tiny_gpt.make_optimizer(chunks, cfg, lr=3e-3)
    return Trainer(dist.get_rank(), chunks, cfg, optimizer)


def converter_args(trainer: Trainer, job: dict, **more: Any) -> Namespace:
    """The arguments the frameworks' ``convert_to_hf`` and bucketing read."""
    from titan_plugins.hosts.megatron.testing import tiny_gpt

    cfg = trainer.cfg
    return Namespace(
        vocab_size=tiny_gpt.VOCAB,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        q_lora_rank=None,
        num_experts=None,
        update_weight_buffer_size=job["buffer_bytes"],
        **more,
    )


def ray_engines(trainer: Trainer, handle_class: Callable[[], Any], url: str) -> list:
    """The Ray handle of the engine at ``url`` on rank 0 (where the frameworks talk to engines);
    none elsewhere."""
    if trainer.rank != 0:
        return []
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    return [handle_class().remote(url)]


def run_updates(job: dict, trainer: Trainer, updater: Any, prefix: str) -> None:
    """Train two steps, run the framework's own ``update_weights()`` (patched by weight_sync),
    load the same weights into the reference engine from disk; ``job["updates"]`` times. Prints
    ``RESULT {records, stats}`` on rank 0."""
    from titan_weight_sync import stats, tiny_llama
    from titan_weight_sync.cpu_engine import EngineClient
    from titan_weight_sync.hf_checkpoint import save_checkpoint
    from titan_weight_sync.megatron_export import gather_hf_weights

    from titan_plugins.hosts.megatron.testing import tiny_gpt

    chunks, cfg = trainer.chunks, trainer.cfg
    records = []
    for version in range(1, job["updates"] + 1):
        tiny_gpt.train(chunks, cfg, steps=2, optimizer=trainer.optimizer)
        updater.update_weights()  # the framework's own, patched by weight_sync
        full = gather_hf_weights(chunks, cfg)
        if trainer.rank == 0:
            checkpoint = save_checkpoint(
                full, tiny_llama.hf_config(cfg), f"{job['out']}/{prefix}_{version}", torch.bfloat16
            )
            EngineClient(job["reference"]).load_from_disk(checkpoint, str(version))
            records.append(
                {
                    "version": EngineClient(job["synced"]).weight_version(),
                    "updater_version": updater.weight_version,
                    "updater_class": type(updater).__name__,
                    "synced": EngineClient(job["synced"]).generate(job["prompts"]),
                    "reference": EngineClient(job["reference"]).generate(job["prompts"]),
                }
            )
    sent = [None] * dist.get_world_size()
    dist.all_gather_object(sent, stats.snapshot())
    if trainer.rank == 0:
        print("RESULT " + json.dumps({"records": records, "stats": sent}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
