"""titan-moe-ep-overlap: DeepEP-style MoE dispatch/combine on torch.distributed, overlapped.

``titan_moe_ep_overlap.buffer.Buffer`` is a DeepEP v1 ``Buffer`` work-alike; ``plugin`` wires it
(or a compatible installed DeepEP) into megatron-core's flex token dispatcher and pipelines the MoE
layer's all-to-alls with expert compute.
"""

from titan_moe_ep_overlap.version import __version__ as __version__
