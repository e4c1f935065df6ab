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
- ``TENames`` (``framework_job.py``): slime's converters know TransformerEngine's names, where
  the attention's input norm is fused into ``linear_qkv``; CPU has no TE, so the local spec's
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

from framework_job import TENames, converter_args, ray_engines, run_updates, start


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

    def slime_groups() -> None:
        from slime.utils.distributed_utils import init_gloo_group

        init_gloo_group()

    trainer = start(job, slime_groups)
    from megatron.core import parallel_state as ps
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed import (
        UpdateWeightFromDistributed,
    )

    updater = UpdateWeightFromDistributed(
        converter_args(trainer, job),
        [TENames(c) for c in trainer.chunks],
        None,
        model_name="llama",
        quantization_config=None,
    )
    # what slime's connect_rollout_engines sets (without its NCCL group)
    updater._is_pp_src_rank = (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )
    updater._group_name = f"slime-pp_{ps.get_pipeline_model_parallel_rank()}"
    updater.rollout_engines = ray_engines(trainer, engine_handle_class, job["synced"])
    run_updates(job, trainer, updater, "slime")


if __name__ == "__main__":
    main()
