"""Upstream-style tests of a tensor-parallel layer that check values (a fixture for
``titan-plugins verify``'s upstream-test runner): a plugin that changes the numbers fails them."""

import importlib.util
import os
import time

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.unit_tests.test_utilities import Utils


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")  # as upstream gates
class TestColumnParallelLinear:
    def setup_method(self, method):
        Utils.initialize_model_parallel(Utils.world_size)
        model_parallel_cuda_manual_seed(123)
        config = TransformerConfig(
            num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True
        )
        self.layer = ColumnParallelLinear(
            16,
            32,
            config=config,
            init_method=torch.nn.init.normal_,
            bias=False,
            gather_output=True,
        ).cuda()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_output_is_the_input_times_the_gathered_weight(self):
        torch.manual_seed(7)
        x = torch.randn(4, 2, 16).cuda()
        out, _ = self.layer(x)
        shards = [torch.empty_like(self.layer.weight) for _ in range(Utils.world_size)]
        torch.distributed.all_gather(shards, self.layer.weight.detach())
        torch.testing.assert_close(out, x @ torch.cat(shards).t())

    def test_output_shape(self):
        out, bias = self.layer(torch.randn(4, 2, 16).cuda())
        assert out.shape == (4, 2, 32) and bias is None

    @pytest.mark.skipif(  # as upstream gates its TE cases: on a probe, not unconditionally
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    )
    def test_with_transformer_engine(self):
        import transformer_engine.pytorch as te

        assert te.Linear(16, 32).weight.shape == (32, 16)

    def test_a_hang_when_asked(self):
        # TITAN_VERIFY_FIXTURE_HANG=1: as a collective whose peers never come; =PATH: only
        # the first time (it leaves PATH), as a test slowed past the stall rule by the load
        hang = os.environ.get("TITAN_VERIFY_FIXTURE_HANG", "")
        if hang == "1" or (hang and not os.path.exists(hang)):
            if hang != "1":
                open(hang, "w").close()
            time.sleep(3600)

    def test_the_tensor_is_on_a_gpu(self):
        # the CPU harness cannot serve it: fails with the plugins off too (not judged)
        assert torch.ones(1).cuda().device.type == "cuda"
