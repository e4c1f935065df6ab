"""Kernel classification: NCCL legacy and modern names, RCCL, MCCL; collective kinds."""

from __future__ import annotations

import pytest
from titan_trace_analysis import kinds


@pytest.mark.parametrize(
    ("name", "cat", "expected"),
    [
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "kernel", kinds.COMM),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", kinds.COMM),
        ("mcclKernel_AllGather_RING_LL_Sum_int8_t(mcclDevComm*, unsigned long, mcclWork*)", "kernel", kinds.COMM),
        ("mcclDevKernel_ReduceScatter_Sum_f32_RING_LL(mcclDevKernelArgsStorage<4096ul>)", "kernel", kinds.COMM),
        ("rcclKernel_AllToAll(void)", "kernel", kinds.COMM),
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
    ],
)
def test_comm_kind(collective: str, pg_desc: str, name: str, expected: str):
    assert kinds.comm_kind(name, collective, pg_desc) == expected
