"""Upstream-style test utilities (a fixture in the shape of Megatron-LM's
``tests/unit_tests/test_utilities.py``): the process group is built from torchrun's variables
with the NCCL backend and a device picked as ``rank % device_count()``, as upstream does."""

import os

import megatron.core.parallel_state as ps
import torch


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    @staticmethod
    def initialize_distributed():
        if torch.distributed.is_initialized():
            return
        torch.cuda.set_device(Utils.rank % torch.cuda.device_count())
        address = os.getenv("MASTER_ADDR", "localhost") + ":" + os.getenv("MASTER_PORT", "29500")
        torch.distributed.init_process_group(
            backend="nccl",
            init_method=f"tcp://{address}",
            world_size=Utils.world_size,
            rank=Utils.rank,
        )

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, **kwargs):
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(tensor_model_parallel_size, **kwargs)

    @staticmethod
    def destroy_model_parallel():
        ps.destroy_model_parallel()
        torch.distributed.barrier()
