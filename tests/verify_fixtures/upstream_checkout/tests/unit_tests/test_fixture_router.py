"""An upstream-style router test that checks values (fixture): the gating is the router's
linear map of the input."""

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.unit_tests.test_utilities import Utils


class TestTopKRouter:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=4,
            num_moe_experts=4,
            moe_router_topk=2,
            use_cpu_initialization=True,
            moe_router_dtype="fp32",
        )
        self.router = TopKRouter(
            config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )
        torch.manual_seed(3)
        with torch.no_grad():  # a known weight, whatever the router's own init left there
            self.router.weight.normal_()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_gating_is_the_linear_map_of_the_input(self):
        x = torch.randn(3, 2, 16)
        expected = F.linear(x, self.router.weight, self.router.bias)
        torch.testing.assert_close(self.router.gating(x), expected)
