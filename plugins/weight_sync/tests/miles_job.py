"""A miles training job's weight update, run on CPU by torchrun against a miles checkout.

Run by ``test_weight_sync_engine.py`` (opt-in: ``MILES_DIR``) as a user's job meets the plugin:
the core activates through its automatic channel, and the patch lands on miles' own
``DistBucketedWeightUpdateMixin.update_weights`` when miles' module is imported. Each rank trains
the tiny Llama-style GPT with megatron-core's own schedules (gloo), then miles' real
``update_weights()`` runs, of ``UpdateWeightFromDistributed`` (``"updater": "broadcast"``) or of
``UpdateWeightP2P`` (``"p2p"``: its constructor's transfer plan, a collective of every rank, and
its own expert pass and source ranks): miles' passes gather every tensor-parallel weight and
convert it with miles' ``convert_to_hf``, and weight_sync sends the buckets from every pipeline
stage's source rank and commits once on rank 0.

What stands in for miles' driver, and why:

- ``EngineHandle`` is a Ray actor with the one method of miles' ``SGLangEngine`` this path calls
  (``get_topology_info``, for the engine's URL);
- miles' ``ParallelState`` is built from megatron's ``parallel_state`` as miles'
  ``create_megatron_parallel_state`` builds it (that function reads ``megatron.training``'s
  global args, which a megatron-core wheel does not ship);
- ``TENames`` (``framework_job.py``): miles' converters, like slime's, know TransformerEngine's
  names;
- the core's CPU harness answers megatron's CUDA-only calls, as in every CPU test;
- SGLang is importable in the trainer (miles' conversion imports it): the SGLang venv's
  site-packages are appended after the trainer's own (``MILES_SGLANG_SITE``);
- miles' ``connect_rollout_engines`` is not called: it builds what miles' own writes use and
  weight_sync's do not (the broadcast's NCCL group; P2P's Mooncake engine and a pinned CPU
  replica of the engine's model, which needs CUDA and miles' SGLang branch), so
  ``sglang_miles_names`` stands in for the three names of that branch ``p2p.py`` imports.

Usage: torchrun --nproc-per-node N miles_job.py JOB_JSON  (prints ``RESULT {...}`` on rank 0)
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import site
import sys
import types

from framework_job import TENames, converter_args, ray_engines, run_updates, start


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


def updater_class(kind: str) -> type:
    """miles' ``UpdateWeightFromDistributed`` (``broadcast``) or ``UpdateWeightP2P`` (``p2p``)."""
    package = "miles.backends.megatron_utils.update_weight.update_weight_from_distributed"
    if kind == "broadcast":
        return importlib.import_module(f"{package}.broadcast").UpdateWeightFromDistributed
    sglang_miles_names()
    return importlib.import_module(f"{package}.p2p").UpdateWeightP2P


def sglang_miles_names() -> None:
    """Stand-ins for the three names miles' ``p2p.py`` imports from miles' own SGLang branch
    (sglang-miles) that SGLang 0.5.23 does not have: ``ParallelismContext`` and
    ``RankParallelismConfig`` (``sglang.srt.distributed.parallel_state``) and
    ``ParameterMapper`` (``sglang.srt.model_loader.parameter_mapper``). Only
    ``connect_rollout_engines`` uses them (the CPU replica of the engine's model it builds for
    miles' own RDMA writes), and this job does not call it."""
    from sglang.srt.distributed import parallel_state

    for name in ("ParallelismContext", "RankParallelismConfig"):
        if not hasattr(parallel_state, name):
            setattr(parallel_state, name, type(name, (), {}))
    mapper = "sglang.srt.model_loader.parameter_mapper"
    if importlib.util.find_spec(mapper) is None:
        module = types.ModuleType(mapper)
        module.ParameterMapper = type("ParameterMapper", (), {})
        sys.modules[mapper] = module


def main() -> None:
    job = json.loads(sys.argv[1])
    sys.path.insert(0, os.environ["MILES_DIR"])
    if os.environ.get("MILES_SGLANG_SITE"):
        site.addsitedir(os.environ["MILES_SGLANG_SITE"])  # after the trainer's own packages

    def miles_groups() -> None:
        from miles.utils.distributed_utils import init_gloo_group

        init_gloo_group()
        miles_parallel_state()

    trainer = start(job, miles_groups)
    args = converter_args(
        trainer, job, swiglu=True, pause_generation_mode=job["pause_mode"],
        megatron_to_hf_mode="raw", sglang_pp_size=1, rollout_num_gpus_per_engine=1,
        rollout_num_gpus=1,
    )  # fmt: skip
    updater = updater_class(job["updater"])(
        args, [TENames(c) for c in trainer.chunks], None, model_name="llama",
        quantization_config=None,
    )  # fmt: skip
    updater.rollout_engines = ray_engines(trainer, engine_handle_class, job["synced"])
    run_updates(job, trainer, updater, "miles")


if __name__ == "__main__":
    main()
