"""Kernel classification: NCCL legacy and modern names, RCCL, MCCL; collective kinds from args,
CPU-side titles (PyTorch's ``nccl:send 0->1``, gloo, Titan's ``titan.p2p:*``) and kernel names."""

from __future__ import annotations

import pytest
from titan_trace_analysis import kinds

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent


@pytest.mark.parametrize(
    ("name", "cat", "expected"),
    [
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "kernel", kinds.COMM),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", kinds.COMM),
        ("mcclKernel_AllGather_RING_LL_Sum_int8_t(mcclDevComm*, unsigned long, mcclWork*)", "kernel", kinds.COMM),
        ("mcclDevKernel_ReduceScatter_Sum_f32_RING_LL(mcclDevKernelArgsStorage<4096ul>)", "kernel", kinds.COMM),
        ("rcclKernel_AllToAll(void)", "kernel", kinds.COMM),
        ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", "kernel", kinds.COMM),
        ("ncclAllReduceRingLLKernel_sum_f32(ncclColl)", "kernel", kinds.COMM),
        ("ncclSendRecvKernel_copy_i8(ncclColl)", "kernel", kinds.COMM),
        ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", kinds.MEMORY),
        ("Memset (Device)", "kernel", kinds.MEMORY),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "kernel", kinds.COMPUTE),
        ("void at::native::nccl_like_name_kernel<float>(float*)", "kernel", kinds.COMPUTE),
    ],
)  # fmt: skip
def test_kernel_class(name: str, cat: str, expected: int):
    assert kinds.kernel_class(name, cat) == expected


@pytest.mark.parametrize(
    ("collective", "pg_desc", "name", "expected"),
    [
        ("send", "pp_group", "ncclDevKernel_SendRecv", kinds.PP_SEND),
        ("recv", "PIPELINE_MODEL_PARALLEL_GROUP", "ncclDevKernel_SendRecv", kinds.PP_RECV),
        ("all_to_allv", "ep_group", "ncclDevKernel_SendRecv", kinds.EP_A2A),
        ("", "EXPERT_MODEL_PARALLEL_GROUP", "ncclDevKernel_SendRecv", kinds.EP_A2A),
        ("_reduce_scatter_base", "dp_group", "x", kinds.REDUCE_SCATTER),
        ("allgather_into_tensor_coalesced", "", "x", kinds.ALL_GATHER),
        ("allreduce", "default_pg", "x", kinds.ALL_REDUCE),
        ("", "", "ncclKernel_AllReduce_RING_LL_Sum_float", kinds.ALL_REDUCE),
        ("", "", "mcclDevKernel_ReduceScatter_Sum_f32", kinds.REDUCE_SCATTER),
        ("broadcast", "", "ncclKernel_Broadcast_RING", kinds.OTHER_COMM),
        ("", "", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", kinds.P2P),
        ("", "", "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", kinds.OTHER_COMM),
    ],
)
def test_comm_kind(collective: str, pg_desc: str, name: str, expected: str):
    assert kinds.comm_kind(name, collective, pg_desc) == expected


@pytest.mark.parametrize(
    ("title", "expected"),
    [
        ("nccl:send 0->1", ((kinds.PP_SEND, 1),)),
        ("nccl:recv 1<-0", ((kinds.PP_RECV, 0),)),
        ("mccl:recv 5<-4", ((kinds.PP_RECV, 4),)),
        ("gloo:recv", ((kinds.PP_RECV, None),)),
        ("gloo:all_to_all", ((kinds.EP_A2A, None),)),
        ("nccl:_allgather_base", ((kinds.ALL_GATHER, None),)),
        ("nccl:reduce_scatter_tensor_coalesced", ((kinds.REDUCE_SCATTER, None),)),
        ("titan.p2p:recv_forward", ((kinds.PP_RECV, "prev"),)),
        ("titan.p2p:send_forward_recv_backward", ((kinds.PP_SEND, "next"), (kinds.PP_RECV, "next"))),
        ("titan.p2p:send_backward_recv_forward", ((kinds.PP_SEND, "prev"), (kinds.PP_RECV, "prev"))),
        ("aten::mm", None),
    ],
)  # fmt: skip
def test_title_parts(title: str, expected):
    assert kinds.title_parts(title) == expected
