"""The generator's catalogue: kernel names, CUDA streams, NCCL kernel names per library and the
per-microbatch layer recipes of a Megatron MoE transformer layer (TE / cuDNN / CUTLASS names, mean
GPU time in microseconds).  Data only; :mod:`gen_traces.lanes` turns it into events.
"""

from __future__ import annotations

from typing import Final

Step = tuple[list[str], str, float, int, int]  # (CPU op stack, kernel, mean GPU us, grid, block)
Recipe = list["Step | str"]  # "D2H_SYNC" marks the MoE tokens-per-expert device-to-host sync

# CUDA streams: compute, pipeline P2P, expert all-to-all, data-parallel collectives
S_COMP, S_PP, S_EP, S_DP = 7, 13, 17, 21

GEMM_L = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas"
GEMM_M = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
GEMM_W = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas"
GEMM_S = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
GGEMM = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecializedCooperative<8, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>, cute::tuple<cute::C<256>, cute::C<128>, cute::C<64> >, cutlass::bfloat16_t, cutlass::bfloat16_t> > >(cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> > >::Params)"
RMS_F = "void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<transformer_engine::normalization::FwdParams, 4096u, 1u, 4u, 1u, 16u, __nv_bfloat16, __nv_bfloat16, float, __nv_bfloat16, float>(transformer_engine::normalization::FwdParams)"
RMS_B = "void transformer_engine::normalization::rmsnorm_bwd_tuned_kernel<transformer_engine::normalization::BwdParams, 4096u, 1u, 4u, 1u, 16u, __nv_bfloat16, __nv_bfloat16, float, __nv_bfloat16, float>(transformer_engine::normalization::BwdParams)"
ROPE_F = "void transformer_engine::fused_rope_forward_kernel<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16 const*, int const*, float const*, __nv_bfloat16*, bool, int, int, int, int, int, int, int, int, int, int, int, int, int)"
ROPE_B = "void transformer_engine::fused_rope_backward_kernel<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16 const*, int const*, float const*, __nv_bfloat16*, bool, int, int, int, int, int, int, int, int, int, int, int, int, int)"
ATT_F = (
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0"
)
ATT_B = (
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x2x1_kernel0_0"
)
ATT_B2 = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_dot_do_o_kernel0_0"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)"
MUL = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >(int, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3>)"
SOFTMAX = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)"
SOFTMAX_B = "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxBackwardEpilogue>(float*, float const*, float const*, int)"
TOPK = "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, at::cuda::detail::TensorInfo<float, unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int, float*)"
REDUCE = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4>)"
HIST = "void at::cuda::kernelHistogram1D<float, float, long, 1, 2, -1, (at::cuda::CUDAHistogramMemoryType)0, at::native::(anonymous namespace)::histc_cuda_template<float>(at::Tensor const&, long, float, float)::{lambda(float)#1}>(at::cuda::detail::TensorInfo<float, long>, at::cuda::detail::TensorInfo<float, long>, at::cuda::detail::TensorInfo<float, long>, int, float, float, long, long, at::native::(anonymous namespace)::histc_cuda_template<float>(at::Tensor const&, long, float, float)::{lambda(float)#1}, long)"
PERM = "void moe_permute_row_map<__nv_bfloat16>(int const*, int*, int, int, int)"
PERM_B = "void moe_unpermute_kernel<__nv_bfloat16, float, true>(__nv_bfloat16 const*, __nv_bfloat16*, int const*, float const*, int, int, int)"
UNPERM = "void moe_unpermute_kernel<__nv_bfloat16, float, false>(__nv_bfloat16 const*, __nv_bfloat16*, int const*, float const*, int, int, int)"
SORTCH = "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>, at::native::index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1} const&)::{lambda(int)#1}>(long, at::native::gpu_index_kernel<at::native::index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>, at::native::index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1} const&)::{lambda(int)#1})"
SWIGLU = "void transformer_engine::gated_act_kernel<8, true, __nv_bfloat16, __nv_bfloat16, float, transformer_engine::Empty, &transformer_engine::silu<float, float>>(__nv_bfloat16 const*, __nv_bfloat16*, float const*, float*, float const*, float*, unsigned long, unsigned long, transformer_engine::Empty)"
SWIGLU_B = "void transformer_engine::dgated_act_kernel<8, true, __nv_bfloat16, __nv_bfloat16, float, transformer_engine::Empty, &transformer_engine::silu<float, float>, &transformer_engine::dsilu<float, float>>(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, unsigned long, unsigned long, transformer_engine::Empty)"
EMB_F = "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<c10::BFloat16 const, unsigned int>, at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, unsigned int, unsigned int, long)"
EMB_B = "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16, float, long>(long const*, c10::BFloat16 const*, c10::BFloat16*, int, long, int, int)"
CE_F = "void (anonymous namespace)::cross_entropy_fwd_kernel<__nv_bfloat16, float>(float*, float*, __nv_bfloat16 const*, long const*, int, int, int, int, bool, float)"
CE_B = "void (anonymous namespace)::cross_entropy_bwd_kernel<__nv_bfloat16, float>(__nv_bfloat16*, float const*, __nv_bfloat16 const*, long const*, float const*, int, int, int, int, bool, float)"
ADAM = "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, float, long>, float, float, float, float, float, float, adamMode_t, float>(long, int volatile*, TensorListMetadata<4>, AdamFunctor<float, float, float, long>, float, float, float, float, float, float, adamMode_t, float)"
L2NORM = "void multi_tensor_apply_kernel<TensorListMetadata<1>, L2NormFunctor<float>, float*, float*, bool, int>(long, int volatile*, TensorListMetadata<1>, L2NormFunctor<float>, float*, float*, bool, int)"
SCALE = "void multi_tensor_apply_kernel<TensorListMetadata<2>, ScaleFunctor<float, float>, float>(long, int volatile*, TensorListMetadata<2>, ScaleFunctor<float, float>, float)"

NCCL_MODERN: Final = {  # NCCL >= 2.19
    "sendrecv": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
    "reduce_scatter": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "all_gather": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "all_reduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
}
NCCL_LEGACY: Final = {  # NCCL 2.12 - 2.18
    "sendrecv": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "reduce_scatter": "ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
    "all_gather": "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "all_reduce": "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
}
RCCL: Final = {  # ROCm RCCL: one generic kernel for every collective, the kind is not in the name
    "sendrecv": "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
    "reduce_scatter": "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
    "all_gather": "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
    "all_reduce": "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
}
MCCL: Final = {  # Moore Threads MCCL (torch_musa)
    "sendrecv": "mcclDevKernel_SendRecv(mcclDevKernelArgsStorage<4096ul>)",
    "reduce_scatter": "mcclDevKernel_ReduceScatter_Sum_f32_RING_LL(mcclDevKernelArgsStorage<4096ul>)",
    "all_gather": "mcclDevKernel_AllGather_RING_LL(mcclDevKernelArgsStorage<4096ul>)",
    "all_reduce": "mcclDevKernel_AllReduce_Sum_f32_RING_LL(mcclDevKernelArgsStorage<4096ul>)",
}
NAMINGS: Final = {"modern": NCCL_MODERN, "legacy": NCCL_LEGACY, "rccl": RCCL, "mccl": MCCL}
# PyTorch's CPU-side profiling title of a collective ("nccl:send 0->1"); torch_musa says "mccl:"
ANNOTATION_PREFIX: Final = {"modern": "nccl:", "legacy": "nccl:", "rccl": "nccl:", "mccl": "mccl:"}

# Layer recipes for one micro-batch, each item a Step.
# "A2A" marks an EP all-to-all; the list element after it is run on the compute stream while
# the all-to-all is in flight (shared expert overlap).
FWD_PRE: Recipe = [
    (["_LayerNormLinear", "tex::rmsnorm_fwd"], RMS_F, 38, 4096, 256),
    (["_LayerNormLinear", "tex::generic_gemm"], GEMM_L, 420, 132, 384),
    (["FusedRoPEFunc", "tex::fused_rope_forward"], ROPE_F, 32, 4096, 128),
    (["FusedRoPEFunc", "tex::fused_rope_forward"], ROPE_F, 32, 4096, 128),
    (["FusedAttnFunc", "tex::fused_attn_fwd"], ATT_F, 780, 1024, 128),
    (["_Linear", "tex::generic_gemm"], GEMM_M, 260, 132, 384),
    (["aten::add"], ADD, 22, 4096, 128),
    (["_LayerNormLinear", "tex::rmsnorm_fwd"], RMS_F, 38, 4096, 256),
    (["aten::linear", "aten::mm"], GEMM_S, 28, 64, 128),
    (["aten::softmax", "aten::_softmax"], SOFTMAX, 14, 4096, 128),
    (["aten::topk"], TOPK, 24, 1024, 256),
    (["aten::sum"], REDUCE, 9, 128, 512),
    (["aten::histc"], HIST, 11, 256, 256),
    "D2H_SYNC",
    (["PermuteMoE_topK", "aten::index_select"], PERM, 55, 2048, 256),
]
FWD_A2A1_OVERLAP: Recipe = [
    (["SharedExpertMLP", "tex::generic_gemm"], GEMM_M, 190, 132, 384),
    (["SharedExpertMLP", "tex::gated_act"], SWIGLU, 30, 4096, 256),
    (["SharedExpertMLP", "tex::generic_gemm"], GEMM_M, 100, 132, 384),
]
FWD_MID: Recipe = [
    (["aten::index_select"], SORTCH, 40, 2048, 128),
    (["GroupedLinear", "tex::te_general_grouped_gemm"], GGEMM, 680, 132, 384),
    (["tex::gated_act"], SWIGLU, 70, 4096, 256),
    (["GroupedLinear", "tex::te_general_grouped_gemm"], GGEMM, 360, 132, 384),
    (["aten::index_select"], SORTCH, 40, 2048, 128),
]
FWD_POST: Recipe = [
    (["UnpermuteMoE_topK", "aten::index_add_"], UNPERM, 60, 2048, 256),
    (["aten::add"], ADD, 22, 4096, 128),
]
BWD_PRE: Recipe = [
    (["UnpermuteMoE_topKBackward", "aten::index_select"], PERM_B, 60, 2048, 256),
]
BWD_A2A1_OVERLAP: Recipe = [
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_M, 100, 132, 384),
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_W, 100, 132, 384),
    (["SharedExpertMLPBackward", "tex::dgated_act"], SWIGLU_B, 35, 4096, 256),
]
BWD_MID: Recipe = [
    (["IndexSelectBackward0", "aten::index_add_"], SORTCH, 40, 2048, 128),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 360, 132, 384),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 360, 132, 384),
    (["GatedActBackward", "tex::dgated_act"], SWIGLU_B, 80, 4096, 256),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 680, 132, 384),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 680, 132, 384),
    (["IndexSelectBackward0", "aten::index_add_"], SORTCH, 40, 2048, 128),
]
BWD_A2A2_OVERLAP: Recipe = [
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_M, 190, 132, 384),
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_W, 190, 132, 384),
]
BWD_POST: Recipe = [
    (["PermuteMoE_topKBackward", "aten::index_add_"], PERM_B, 55, 2048, 256),
    (["TopkBackward0", "aten::scatter"], SORTCH, 18, 1024, 128),
    (["SoftmaxBackward0", "aten::_softmax_backward_data"], SOFTMAX_B, 16, 4096, 128),
    (["MmBackward0", "aten::mm"], GEMM_S, 28, 64, 128),
    (["MmBackward0", "aten::mm"], GEMM_S, 28, 64, 128),
    (["_LayerNormLinearBackward", "tex::rmsnorm_bwd"], RMS_B, 60, 4096, 256),
    (["aten::add"], ADD, 22, 4096, 128),
    (["_LinearBackward", "tex::generic_gemm"], GEMM_M, 260, 132, 384),
    (["_LinearBackward", "tex::generic_gemm"], GEMM_W, 260, 132, 384),
    (["FusedAttnFuncBackward", "tex::fused_attn_bwd"], ATT_B2, 30, 4096, 128),
    (["FusedAttnFuncBackward", "tex::fused_attn_bwd"], ATT_B, 1600, 1024, 256),
    (["FusedRoPEFuncBackward", "tex::fused_rope_backward"], ROPE_B, 32, 4096, 128),
    (["FusedRoPEFuncBackward", "tex::fused_rope_backward"], ROPE_B, 32, 4096, 128),
    (["_LayerNormLinearBackward", "tex::generic_gemm"], GEMM_M, 420, 132, 384),
    (["_LayerNormLinearBackward", "tex::generic_gemm"], GEMM_W, 420, 132, 384),
    (["_LayerNormLinearBackward", "tex::rmsnorm_bwd"], RMS_B, 60, 4096, 256),
    (["aten::add_"], ADD, 22, 4096, 128),
    (["aten::add_"], ADD, 22, 4096, 128),
]
EXTRA_CPU: Final = [
    "aten::empty",
    "aten::view",
    "aten::t",
    "aten::as_strided",
    "aten::reshape",
    "aten::detach",
]
