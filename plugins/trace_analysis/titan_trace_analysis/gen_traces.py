#!/usr/bin/env python3
# ruff: noqa: UP031  -- events are formatted with %-strings on purpose (speed, fixed float format)
"""Synthetic multi-rank PyTorch-profiler (Kineto, Chrome-trace JSON) generator for a
Megatron-LM style MoE training job: pipeline parallel (1F1B) x expert parallel
(all-to-all token dispatch/combine) x data parallel (reduce-scatter / all-gather /
all-reduce at step end).  tp = 1.  Scratch research code.

Per rank it writes rank-<r>.json.gz with the same structure as real Kineto traces
(see HTA tests/data): top-level schemaVersion, deviceProperties, distributedInfo
{backend, rank, world_size, pg_count, pg_config, nccl_version} before "traceEvents";
traceName/displayTimeUnit/baseTimeNanoseconds after it.  Events:
  * cpu_op (nested, forward on the main thread, backward on pt_autograd_0 thread)
  * user_annotation ProfilerStep#<k> on the main thread, nccl:<coll> annotations
  * cuda_runtime cudaLaunchKernel / cudaLaunchKernelExC / cudaMemcpyAsync /
    cudaEventRecord / cudaStreamWaitEvent / cudaStreamSynchronize
  * kernel (compute stream 7), NCCL kernels on PP stream 13, EP stream 17, DP stream 21
  * gpu_memcpy (D2H tokens-per-expert copy), cuda_sync (Stream Wait Event, Stream Sync)
  * ac2g flow start/finish pairs (correlation id), fwdbwd flow pairs
  * ph:M process/thread names, a "Trace" span, instant events
Timing model: discrete-event simulation.  GPU start = max(launch + latency, stream free,
cross-stream event dependency).  EP all-to-all kernels of one EP group all end at
max(start over group) + transfer time, so early ranks show long (waiting) a2a kernels.
PP recv kernels end at max(recv start, matching send start) + transfer (send kernels are
approximated as not waiting for the receiver).  DP collectives likewise.  The CPU blocks
at the MoE tokens-per-expert D2H sync and at the grad-norm .item().  A configurable slow
rank multiplies its compute-kernel durations (GPU straggler).

Copied from the project's shared/tools/gen_traces.py and extended to emit its ground truth
(``generate()`` returns it; the CLI writes it to ``<out>.geninfo.json``, outside the trace
directory): the injected slow ranks and factor, per rank and step the pipeline bubble (time the
compute stream is idle while a pipeline receive is outstanding, inside the rank's step window
[ProfilerStep start, end of the last GPU op launched in the step]), per-stage bubble ratios and
the step time (latest GPU end of the step over all ranks minus that of the previous step; for
the first step minus the earliest ProfilerStep start).
Truth is computed from the simulator's own state, not by reading the written files.
"""

import argparse
import json
import math
import os
import random
import subprocess
import time

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

NCCL_MODERN = {
    "sendrecv": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
    "reduce_scatter": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "all_gather": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "all_reduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
}
NCCL_LEGACY = {
    "sendrecv": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "reduce_scatter": "ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
    "all_gather": "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "all_reduce": "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
}

# (cpu stack, kernel, mean GPU us, grid x, block x).  Layer recipes for one micro-batch.
# "A2A" marks an EP all-to-all; the list element after it is run on the compute stream while
# the all-to-all is in flight (shared expert overlap).
FWD_PRE = [
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
FWD_A2A1_OVERLAP = [
    (["SharedExpertMLP", "tex::generic_gemm"], GEMM_M, 190, 132, 384),
    (["SharedExpertMLP", "tex::gated_act"], SWIGLU, 30, 4096, 256),
    (["SharedExpertMLP", "tex::generic_gemm"], GEMM_M, 100, 132, 384),
]
FWD_MID = [
    (["aten::index_select"], SORTCH, 40, 2048, 128),
    (["GroupedLinear", "tex::te_general_grouped_gemm"], GGEMM, 680, 132, 384),
    (["tex::gated_act"], SWIGLU, 70, 4096, 256),
    (["GroupedLinear", "tex::te_general_grouped_gemm"], GGEMM, 360, 132, 384),
    (["aten::index_select"], SORTCH, 40, 2048, 128),
]
FWD_POST = [
    (["UnpermuteMoE_topK", "aten::index_add_"], UNPERM, 60, 2048, 256),
    (["aten::add"], ADD, 22, 4096, 128),
]
BWD_PRE = [
    (["UnpermuteMoE_topKBackward", "aten::index_select"], PERM_B, 60, 2048, 256),
]
BWD_A2A1_OVERLAP = [
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_M, 100, 132, 384),
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_W, 100, 132, 384),
    (["SharedExpertMLPBackward", "tex::dgated_act"], SWIGLU_B, 35, 4096, 256),
]
BWD_MID = [
    (["IndexSelectBackward0", "aten::index_add_"], SORTCH, 40, 2048, 128),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 360, 132, 384),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 360, 132, 384),
    (["GatedActBackward", "tex::dgated_act"], SWIGLU_B, 80, 4096, 256),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 680, 132, 384),
    (["GroupedLinearBackward", "tex::te_general_grouped_gemm"], GGEMM, 680, 132, 384),
    (["IndexSelectBackward0", "aten::index_add_"], SORTCH, 40, 2048, 128),
]
BWD_A2A2_OVERLAP = [
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_M, 190, 132, 384),
    (["SharedExpertMLPBackward", "tex::generic_gemm"], GEMM_W, 190, 132, 384),
]
BWD_POST = [
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
EXTRA_CPU = [
    "aten::empty",
    "aten::view",
    "aten::t",
    "aten::as_strided",
    "aten::reshape",
    "aten::detach",
]


def q(s):
    return json.dumps(s)


class Writer:
    """Streams one rank's trace; events are appended as pre-formatted JSON strings.
    Compression runs in an external `gzip -1` process (uses the second core)."""

    def __init__(self, path, header_obj, tail_obj, gz=True):
        self.path = path
        self.fh = open(path, "wb")
        self.proc = None
        if gz:
            self.proc = subprocess.Popen(
                ["gzip", "-1", "-c"], stdin=subprocess.PIPE, stdout=self.fh
            )
            self.out = self.proc.stdin
        else:
            self.out = self.fh
        head = json.dumps(header_obj)[:-1]  # drop closing brace
        self.out.write((head + ', "traceEvents": [\n').encode())
        self.tail_obj = tail_obj
        self.buf = []
        self.n = 0
        self.first = True

    def add(self, s):
        self.buf.append(s)
        if len(self.buf) >= 4096:
            self.flush()

    def flush(self):
        if self.buf:
            data = ",\n".join(self.buf)
            if not self.first:
                data = ",\n" + data
            self.first = False
            self.out.write(data.encode())
            self.n += len(self.buf)
            self.buf = []

    def close(self):
        self.flush()
        tail = json.dumps(self.tail_obj)[1:]
        self.out.write(("\n], " + tail + "\n").encode())
        if self.proc:
            self.proc.stdin.close()
            self.proc.wait()
        self.fh.close()
        return self.n


class Lane:
    """State of one rank."""

    def __init__(self, cfg, rank, writer, rng):
        self.cfg = cfg
        self.rank = rank
        self.w = writer
        self.rng = rng
        self.pid = 100000 + rank * 17
        self.tid_main = self.pid
        self.tid_bwd = self.pid + 5
        self.dev = rank % 8
        self.gpid = self.dev
        self.cpu = cfg.base + rng.uniform(0, 50)  # small per-rank start offset
        self.free = {S_COMP: self.cpu, S_PP: self.cpu, S_EP: self.cpu, S_DP: self.cpu}
        self.ext = rank * 10_000_000 + 1
        self.corr = rank * 10_000_000 + 1
        self.evid = 1
        self.fb = 1
        self.slow = cfg.slow_factor if rank in cfg.slow_ranks else 1.0
        self.nk = 0
        self.fwd_anchor = {}
        self.truth = []  # per step: {"start", "gpu_start", "gpu_end", "comp": [...], "recv": [...]}

    def begin_step(self):
        """Open a ground-truth record for the step that starts now (CPU time)."""
        self.truth.append(
            {"start": self.cpu, "gpu_start": math.inf, "gpu_end": 0.0, "comp": [], "recv": []}
        )

    # ---- helpers -------------------------------------------------------------------------
    def j(self, mean, sig=0.06):
        return mean * math.exp(self.rng.gauss(0.0, sig))

    def cpu_x(self, cat, name, ts, dur, tid, args=None):
        a = args if args is not None else '{"External id": %d}' % self.ext
        self.w.add(
            '{"ph": "X", "cat": "%s", "name": %s, "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, "args": %s}'
            % (cat, q(name), self.pid, tid, ts, dur, a)
        )

    def runtime(self, name, ts, dur, tid, cbid, corr):
        self.w.add(
            '{"ph": "X", "cat": "cuda_runtime", "name": "%s", "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, "args": {"External id": %d, "cbid": %d, "correlation": %d}}'
            % (name, self.pid, tid, ts, dur, self.ext, cbid, corr)
        )

    def flow(self, corr, ts_cpu, tid, ts_gpu, stream):
        self.w.add(
            '{"ph": "s", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "ac2g", "name": "ac2g"}'
            % (corr, self.pid, tid, ts_cpu)
        )
        self.w.add(
            '{"ph": "f", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "ac2g", "name": "ac2g", "bp": "e"}'
            % (corr, self.gpid, stream, ts_gpu)
        )

    def extra_cpu(self, tid):
        if self.nk % 2 == 0:
            d = self.j(3.0, 0.3)
            self.cpu_x("cpu_op", EXTRA_CPU[self.nk % len(EXTRA_CPU)], self.cpu, d, tid)
            self.cpu += d + 0.6

    # ---- kernel launch -------------------------------------------------------------------
    def launch(
        self,
        stack,
        kname,
        gpu_us,
        grid,
        block,
        tid,
        stream=S_COMP,
        dep=0.0,
        scale=True,
        runtime_name="cudaLaunchKernel",
        cbid=211,
        kargs_extra="",
        cat="kernel",
        defer=False,
    ):
        """CPU side: nested cpu_ops + runtime + flow start.  GPU side: kernel + flow end.
        Returns (start, end, corr).  With defer=True, the kernel is not written; the caller
        completes it with finish_kernel() once the end time is known (collectives)."""
        self.extra_cpu(tid)
        self.ext += 1
        self.corr += 1
        corr = self.corr
        t = self.cpu
        opened = []
        for name in stack:
            opened.append((name, t))
            t += self.j(2.5, 0.3)
        rt_dur = self.j(5.0, 0.25)
        rt_ts = t
        self.runtime(runtime_name, rt_ts, rt_dur, tid, cbid, corr)
        t = rt_ts + rt_dur
        for name, t0 in reversed(opened):
            t += self.j(1.2, 0.3)
            self.cpu_x("cpu_op", name, t0, t - t0, tid)
        self.cpu = t + self.j(4.0, 0.4)  # python overhead between ops
        start = max(rt_ts + self.j(3.0, 0.2), self.free[stream], dep)
        dur = self.j(gpu_us) * (self.slow if scale else 1.0)
        end = start + dur
        self.nk += 1
        if defer:
            return start, None, (corr, rt_ts, tid, kname, grid, block, kargs_extra, stream, cat)
        self.free[stream] = end
        self.kernel(corr, rt_ts, tid, kname, start, dur, grid, block, kargs_extra, stream, cat)
        return start, end, corr

    def kernel(
        self, corr, rt_ts, tid, kname, start, dur, grid, block, kargs_extra, stream, cat="kernel"
    ):
        if self.truth:
            tr = self.truth[-1]
            tr["gpu_start"] = min(tr["gpu_start"], start)
            tr["gpu_end"] = max(tr["gpu_end"], start + dur)
            if cat == "kernel" and not kname.startswith("nccl"):
                tr["comp"].append((start, start + dur))
        if cat == "gpu_memcpy":
            self.w.add(
                '{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, "args": {"External id": %d, "device": %d, "context": 1, "stream": %d, "correlation": %d, "bytes": 1024, "memory bandwidth (GB/s)": 0.5}}'
                % (self.gpid, stream, start, dur, self.ext, self.dev, stream, corr)
            )
        else:
            self.w.add(
                '{"ph": "X", "cat": "kernel", "name": %s, "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, "args": {"External id": %d, "queued": 0, "device": %d, "context": 1, "stream": %d, "correlation": %d, "registers per thread": 128, "shared memory": 65536, "blocks per SM": %.6f, "warps per SM": %.6f, "grid": [%d, 1, 1], "block": [%d, 1, 1], "est. achieved occupancy %%": 25%s}}'
                % (
                    q(kname),
                    self.gpid,
                    stream,
                    start,
                    dur,
                    self.ext,
                    self.dev,
                    stream,
                    corr,
                    grid / 132.0,
                    grid * block / 32.0 / 132.0,
                    grid,
                    block,
                    kargs_extra,
                )
            )
        self.flow(corr, rt_ts, tid, start, stream)

    def finish_kernel(self, pend, start, end):
        corr, rt_ts, tid, kname, grid, block, kargs_extra, stream, cat = pend
        self.free[stream] = end
        self.kernel(
            corr, rt_ts, tid, kname, start, end - start, grid, block, kargs_extra, stream, cat
        )

    # ---- stream/event sync ---------------------------------------------------------------
    def event_record(self, stream, tid):
        self.ext += 1
        self.corr += 1
        d = self.j(2.0, 0.2)
        self.runtime("cudaEventRecord", self.cpu, d, tid, 135, self.corr)
        self.cpu += d + 0.5
        self.evid += 1
        return (self.corr, self.evid, stream, self.free[stream])

    def stream_wait(self, dst, rec, tid):
        rcorr, evid, src, t_done = rec
        self.ext += 1
        self.corr += 1
        d = self.j(2.0, 0.2)
        rt = self.cpu
        self.runtime("cudaStreamWaitEvent", rt, d, tid, 147, self.corr)
        self.cpu += d + 0.5
        if self.cfg.cuda_sync:
            gts = max(rt + 2.0, self.free[dst])
            self.w.add(
                '{"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": %d, "tid": %d, "ts": %.3f, "dur": 1.000, "args": {"External id": %d, "cuda_sync_kind": "Stream Wait Event", "wait_on_stream": %d, "wait_on_cuda_event_record_corr_id": %d, "wait_on_cuda_event_id": %d, "stream": %d, "correlation": %d, "device": %d, "context": 1}}'
                % (self.gpid, dst, gts, self.ext, src, rcorr, evid, dst, self.corr, self.dev)
            )
            self.flow(self.corr, rt, tid, gts, dst)
        self.free[dst] = max(self.free[dst], t_done)

    def d2h_sync(self, tid):
        """tokens_per_expert.cpu(): D2H copy + cudaStreamSynchronize (CPU waits for GPU)."""
        s, e, _ = self.launch(
            ["aten::to", "aten::_to_copy", "aten::copy_"],
            None,
            2.5,
            0,
            0,
            tid,
            runtime_name="cudaMemcpyAsync",
            cbid=41,
            cat="gpu_memcpy",
            scale=False,
        )
        self.ext += 1
        self.corr += 1
        rt = self.cpu
        wait_end = max(rt + 3.0, e + 2.0)
        self.runtime("cudaStreamSynchronize", rt, wait_end - rt, tid, 131, self.corr)
        if self.cfg.cuda_sync:
            self.w.add(
                '{"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, "args": {"External id": %d, "cuda_sync_kind": "Stream Sync", "stream": %d, "correlation": %d, "device": %d, "context": 1}}'
                % (self.gpid, S_COMP, e, 1.0, self.ext, S_COMP, self.corr, self.dev)
            )
            self.flow(self.corr, rt, tid, e, S_COMP)
        self.cpu = wait_end + self.j(3.0)

    def run(self, recipe, tid):
        for item in recipe:
            if item == "D2H_SYNC":
                self.d2h_sync(tid)
            else:
                stack, k, us, g, b = item
                self.launch(stack, k, us, g, b, tid)

    # ---- collectives ---------------------------------------------------------------------
    def nccl_post(
        self, coll, kind, stream, tid, group, nelems, dep=0.0, pg_name="0", pg_desc="default_pg"
    ):
        ranks_s = (
            "[" + ", ".join(str(r) for r in group) + "]"
            if len(group) <= 64
            else "[%d, ..., %d]" % (group[0], group[-1])
        )
        cargs = (
            '"Collective name": "%s", "In msg nelems": %d, "Out msg nelems": %d, "Group size": %d, "dtype": "BFloat16", "In split size": "[]", "Out split size": "[]", "Process Group Name": "%s", "Process Group Description": "%s", "Process Group Ranks": "%s"'
            % (coll, nelems, nelems, len(group), pg_name, pg_desc, ranks_s)
        )
        # user annotation + record_param_comms around the launch
        t0 = self.cpu
        self.ext += 1
        ann_ext = self.ext
        self.cpu += self.j(3.0)
        t1 = self.cpu
        self.cpu += self.j(6.0)
        kname = self.cfg.nccl[kind]
        start, _, pend = self.launch(
            ["record_param_comms"],
            kname,
            0.0,
            8,
            544,
            tid,
            stream=stream,
            dep=dep,
            scale=False,
            runtime_name="cudaLaunchKernelExC",
            cbid=430,
            kargs_extra=", " + cargs,
            defer=True,
        )
        t2 = self.cpu
        self.cpu_x(
            "cpu_op",
            "c10d::" + coll + "_",
            t1,
            t2 - t1,
            tid,
            '{"External id": %d, %s}' % (ann_ext, cargs),
        )
        self.cpu += self.j(2.0)
        self.cpu_x(
            "user_annotation",
            "nccl:" + coll,
            t0,
            self.cpu - t0,
            tid,
            '{"External id": %d}' % ann_ext,
        )
        return start, pend


def _tid_main(ln):
    return ln.tid_main


def _tid_bwd(ln):
    return ln.tid_bwd


def schedule_1f1b(pp, s, M):
    warm = min(pp - s - 1, M)
    ops = [("F", m) for m in range(warm)]
    for i in range(M - warm):
        ops.append(("F", warm + i))
        ops.append(("B", i))
    ops += [("B", m) for m in range(M - warm, M)]
    return ops


class Sim:
    def __init__(self, cfg):
        self.cfg = cfg
        self.pp, self.dp, self.ep = cfg.pp, cfg.dp, cfg.ep
        self.world = cfg.pp * cfg.dp
        os.makedirs(cfg.out, exist_ok=True)
        self.lanes = {}
        for r in range(self.world):
            s, d = self.coords(r)
            pgs = [
                {
                    "pg_name": "0",
                    "pg_desc": "default_pg",
                    "backend_config": "cuda:nccl",
                    "pg_size": self.world,
                    "ranks": list(range(self.world)),
                },
                {
                    "pg_name": "1",
                    "pg_desc": "pp_group",
                    "backend_config": "cuda:nccl",
                    "pg_size": self.pp,
                    "ranks": self.pp_group(d),
                },
                {
                    "pg_name": "2",
                    "pg_desc": "ep_group",
                    "backend_config": "cuda:nccl",
                    "pg_size": self.ep,
                    "ranks": self.ep_group(s, d),
                },
                {
                    "pg_name": "3",
                    "pg_desc": "dp_group",
                    "backend_config": "cuda:nccl",
                    "pg_size": self.dp,
                    "ranks": self.dp_group(s),
                },
                {
                    "pg_name": "4",
                    "pg_desc": "expert_dp_group",
                    "backend_config": "cuda:nccl",
                    "pg_size": self.dp // self.ep,
                    "ranks": self.edp_group(s, d),
                },
            ]
            header = {
                "schemaVersion": 1,
                "deviceProperties": [
                    {
                        "id": i,
                        "name": "NVIDIA H100 80GB HBM3",
                        "totalGlobalMem": 85045346304,
                        "computeMajor": 9,
                        "computeMinor": 0,
                        "maxThreadsPerBlock": 1024,
                        "maxThreadsPerMultiprocessor": 2048,
                        "regsPerBlock": 65536,
                        "warpSize": 32,
                        "sharedMemPerBlock": 49152,
                        "numSms": 132,
                        "regsPerMultiprocessor": 65536,
                        "sharedMemPerBlockOptin": 232448,
                        "sharedMemPerMultiprocessor": 233472,
                    }
                    for i in range(8)
                ],
                "distributedInfo": {
                    "backend": "nccl",
                    "rank": r,
                    "world_size": self.world,
                    "pg_count": len(pgs),
                    "pg_config": pgs,
                    "nccl_version": "2.21.5",
                },
                "record_shapes": 0,
            }
            tail = {
                "traceName": "rank-%d.json" % r,
                "displayTimeUnit": "ms",
                "baseTimeNanoseconds": 1700000000000000000,
            }
            ext = ".json.gz" if cfg.gzip else ".json"
            w = Writer(os.path.join(cfg.out, "rank-%d%s" % (r, ext)), header, tail, cfg.gzip)
            self.lanes[r] = Lane(cfg, r, w, random.Random(cfg.seed * 100003 + r))

    # Megatron order tp-cp-ep-dp-pp with tp=cp=1: rank = d + dp * s
    def coords(self, r):
        return r // self.dp, r % self.dp

    def rank(self, s, d):
        return d + self.dp * s

    def pp_group(self, d):
        return [self.rank(s, d) for s in range(self.pp)]

    def ep_group(self, s, d):
        g = d // self.ep
        return [self.rank(s, g * self.ep + i) for i in range(self.ep)]

    def dp_group(self, s):
        return [self.rank(s, d) for d in range(self.dp)]

    def edp_group(self, s, d):
        return [self.rank(s, dd) for dd in range(self.dp) if dd % self.ep == d % self.ep]

    # ---- collective helper: all members post, then all end together ---------------------
    def collective(
        self,
        lanes,
        coll,
        kind,
        stream,
        tid_of,
        group,
        nelems,
        xfer_us,
        deps=None,
        pg=("0", "default_pg"),
    ):
        posts = []
        for i, ln in enumerate(lanes):
            dep = deps[i] if deps else 0.0
            posts.append(
                ln.nccl_post(coll, kind, stream, tid_of(ln), group, nelems, dep, pg[0], pg[1])
            )
        t_all = max(p[0] for p in posts)
        x = xfer_us * math.exp(lanes[0].rng.gauss(0, 0.08))
        for ln, (st, pend) in zip(lanes, posts):
            ln.finish_kernel(pend, st, t_all + x + ln.rng.uniform(0, 3.0))

    def a2a(self, lanes, tid_of, overlap_recipe, s, d0):
        cfg = self.cfg
        recs = [ln.event_record(S_COMP, tid_of(ln)) for ln in lanes]
        for ln, rec in zip(lanes, recs):
            ln.stream_wait(S_EP, rec, tid_of(ln))
        grp = [ln.rank for ln in lanes]
        self.collective(
            lanes,
            "all_to_allv",
            "sendrecv",
            S_EP,
            tid_of,
            grp,
            4096 * 7168 * 8 // len(grp),
            cfg.a2a_us * (1.0 + 0.3 * lanes[0].rng.random()),
            pg=("2", "ep_group"),
        )
        for ln in lanes:
            tid = tid_of(ln)
            rec = ln.event_record(S_EP, tid)
            ln.run(overlap_recipe, tid)
            ln.stream_wait(S_COMP, rec, tid)

    def layer(self, lanes, kind, m, layer, s, d0):
        if kind == "F":
            tid_of = _tid_main
            for ln in lanes:
                ln.fwd_anchor[(m, layer)] = (
                    ln.cpu + 0.0
                )  # next cpu_op starts exactly here (extra_cpu or stack)
                ln.run(FWD_PRE, ln.tid_main)
            self.a2a(lanes, tid_of, FWD_A2A1_OVERLAP, s, d0)
            for ln in lanes:
                ln.run(FWD_MID, ln.tid_main)
            self.a2a(lanes, tid_of, [], s, d0)
            for ln in lanes:
                ln.run(FWD_POST, ln.tid_main)
        else:
            tid_of = _tid_bwd
            for ln in lanes:
                t = ln.cpu
                name = "autograd::engine::evaluate_function: UnpermuteMoE_topKBackward"
                d = ln.j(4.0, 0.2)
                ln.cpu_x("cpu_op", name, t, d, ln.tid_bwd)
                if self.cfg.fwdbwd and (m, layer) in ln.fwd_anchor:
                    ln.fb += 1
                    ts_f = ln.fwd_anchor.pop((m, layer))
                    ln.w.add(
                        '{"ph": "s", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "fwdbwd", "name": "fwdbwd"}'
                        % (ln.fb, ln.pid, ln.tid_main, ts_f)
                    )
                    ln.w.add(
                        '{"ph": "f", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "fwdbwd", "name": "fwdbwd", "bp": "e"}'
                        % (ln.fb, ln.pid, ln.tid_bwd, t)
                    )
                ln.cpu += d + 0.5
                ln.run(BWD_PRE, ln.tid_bwd)
            self.a2a(lanes, tid_of, BWD_A2A1_OVERLAP, s, d0)
            for ln in lanes:
                ln.run(BWD_MID, ln.tid_bwd)
            self.a2a(lanes, tid_of, BWD_A2A2_OVERLAP, s, d0)
            for ln in lanes:
                ln.run(BWD_POST, ln.tid_bwd)

    def p2p_recv(self, lanes, kind, m, s, sent, key):
        tid_of = _tid_main if kind == "F" else _tid_bwd
        for i, ln in enumerate(lanes):
            peer_s = s - 1 if kind == "F" else s + 1
            peer = self.rank(peer_s, self.coords(ln.rank)[1])
            st, pend = ln.nccl_post(
                "recv",
                "sendrecv",
                S_PP,
                tid_of(ln),
                [peer, ln.rank],
                4096 * 7168,
                pg_name="1",
                pg_desc="pp_group",
            )
            send_start = sent[key][i]
            end = max(st, send_start) + ln.j(self.cfg.p2p_us, 0.05)
            ln.finish_kernel(pend, st, end)
            if ln.truth:
                ln.truth[-1]["recv"].append((st, end))
            rec = ln.event_record(S_PP, tid_of(ln))
            ln.stream_wait(S_COMP, rec, tid_of(ln))

    def p2p_send(self, lanes, kind, m, s, sent, key):
        tid_of = _tid_main if kind == "F" else _tid_bwd
        starts = []
        for ln in lanes:
            rec = ln.event_record(S_COMP, tid_of(ln))
            ln.stream_wait(S_PP, rec, tid_of(ln))
            peer_s = s + 1 if kind == "F" else s - 1
            peer = self.rank(peer_s, self.coords(ln.rank)[1])
            st, pend = ln.nccl_post(
                "send",
                "sendrecv",
                S_PP,
                tid_of(ln),
                [ln.rank, peer],
                4096 * 7168,
                pg_name="1",
                pg_desc="pp_group",
            )
            ln.finish_kernel(pend, st, st + ln.j(self.cfg.p2p_us, 0.05))
            starts.append(st)
        sent[key] = starts

    def run_op(self, s, kind, m, lanes, sent):
        pp, L = self.pp, self.cfg.layers
        d0 = self.coords(lanes[0].rank)[1]
        if kind == "F":
            if s > 0:
                self.p2p_recv(lanes, "F", m, s, sent, ("F", m, s - 1))
            else:
                for ln in lanes:
                    ln.launch(
                        ["VocabParallelEmbedding", "aten::embedding"],
                        EMB_F,
                        60,
                        4096,
                        128,
                        ln.tid_main,
                    )
            for layer in range(L):
                self.layer(lanes, "F", m, layer, s, d0)
            if s < pp - 1:
                self.p2p_send(lanes, "F", m, s, sent, ("F", m, s))
            else:
                for ln in lanes:
                    ln.launch(
                        ["_LayerNormLinear", "tex::rmsnorm_fwd"], RMS_F, 38, 4096, 256, ln.tid_main
                    )
                    ln.launch(
                        ["ColumnParallelLinear", "tex::generic_gemm"],
                        GEMM_L,
                        900,
                        132,
                        384,
                        ln.tid_main,
                    )
                    ln.launch(
                        ["_VocabParallelCrossEntropy", "aten::max"],
                        REDUCE,
                        80,
                        4096,
                        512,
                        ln.tid_main,
                    )
                    ln.launch(
                        ["_VocabParallelCrossEntropy", "aten::exp"],
                        CE_F,
                        90,
                        4096,
                        256,
                        ln.tid_main,
                    )
        else:
            if s < pp - 1:
                self.p2p_recv(lanes, "B", m, s, sent, ("B", m, s + 1))
            else:
                for ln in lanes:
                    ln.launch(
                        ["_VocabParallelCrossEntropyBackward", "aten::mul"],
                        CE_B,
                        90,
                        4096,
                        256,
                        ln.tid_bwd,
                    )
                    ln.launch(
                        ["ColumnParallelLinearBackward", "tex::generic_gemm"],
                        GEMM_M,
                        900,
                        132,
                        384,
                        ln.tid_bwd,
                    )
                    ln.launch(
                        ["ColumnParallelLinearBackward", "tex::generic_gemm"],
                        GEMM_W,
                        900,
                        132,
                        384,
                        ln.tid_bwd,
                    )
            for layer in reversed(range(L)):
                self.layer(lanes, "B", m, layer, s, d0)
            if s > 0:
                self.p2p_send(lanes, "B", m, s, sent, ("B", m, s))
            else:
                for ln in lanes:
                    ln.launch(
                        ["EmbeddingBackward0", "aten::embedding_dense_backward"],
                        EMB_B,
                        120,
                        4096,
                        128,
                        ln.tid_bwd,
                    )
        if kind == "B":  # main thread resumes after backward
            for ln in lanes:
                ln.cpu += ln.j(5.0)

    def pipeline(self, g):
        pp, M = self.pp, self.cfg.microbatches
        ops = [schedule_1f1b(pp, s, M) for s in range(pp)]
        lanes = [
            [self.lanes[self.rank(s, g * self.ep + i)] for i in range(self.ep)] for s in range(pp)
        ]
        ptr = [0] * pp
        sent = {}
        while any(ptr[s] < len(ops[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                while ptr[s] < len(ops[s]):
                    kind, m = ops[s][ptr[s]]
                    if kind == "F" and s > 0 and ("F", m, s - 1) not in sent:
                        break
                    if kind == "B" and s < pp - 1 and ("B", m, s + 1) not in sent:
                        break
                    if kind == "B" and s == pp - 1:
                        pass
                    self.run_op(s, kind, m, lanes[s], sent)
                    ptr[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("pipeline deadlock")

    def step_end(self, s):
        cfg = self.cfg
        lanes = [self.lanes[r] for r in self.dp_group(s)]
        tm = _tid_main
        # wait for backward (compute stream) before grad reduce-scatter
        for ln in lanes:
            rec = ln.event_record(S_COMP, ln.tid_main)
            ln.stream_wait(S_DP, rec, ln.tid_main)
        for _b in range(cfg.buckets):
            self.collective(
                lanes,
                "reduce_scatter_tensor_coalesced",
                "reduce_scatter",
                S_DP,
                tm,
                self.dp_group(s),
                40_000_000,
                cfg.dp_us,
                pg=("3", "dp_group"),
            )
        for e in range(self.ep):
            sub = [ln for ln in lanes if self.coords(ln.rank)[1] % self.ep == e]
            if len(sub) > 1:
                for _b in range(cfg.buckets):
                    self.collective(
                        sub,
                        "reduce_scatter_tensor_coalesced",
                        "reduce_scatter",
                        S_DP,
                        tm,
                        [x.rank for x in sub],
                        80_000_000,
                        cfg.dp_us,
                        pg=("4", "expert_dp_group"),
                    )
        for ln in lanes:
            rec = ln.event_record(S_DP, ln.tid_main)
            ln.stream_wait(S_COMP, rec, ln.tid_main)
            for _ in range(4):
                ln.launch(
                    ["DistributedOptimizer.step", "multi_tensor_l2norm"],
                    L2NORM,
                    90,
                    1320,
                    512,
                    ln.tid_main,
                )
        self.collective(
            lanes,
            "all_reduce",
            "all_reduce",
            S_COMP,
            tm,
            self.dp_group(s),
            1,
            30.0,
            pg=("3", "dp_group"),
        )
        for ln in lanes:
            ln.d2h_sync(ln.tid_main)  # grad_norm.item()
            for _ in range(2):
                ln.launch(
                    ["DistributedOptimizer.step", "multi_tensor_scale"],
                    SCALE,
                    120,
                    1320,
                    512,
                    ln.tid_main,
                )
            for _ in range(cfg.adam_kernels):
                ln.launch(
                    ["DistributedOptimizer.step", "FusedAdam.step", "multi_tensor_adam"],
                    ADAM,
                    220,
                    1320,
                    512,
                    ln.tid_main,
                )
            rec = ln.event_record(S_COMP, ln.tid_main)
            ln.stream_wait(S_DP, rec, ln.tid_main)
        for _b in range(cfg.buckets):
            self.collective(
                lanes,
                "all_gather_into_tensor_coalesced",
                "all_gather",
                S_DP,
                tm,
                self.dp_group(s),
                20_000_000,
                cfg.dp_us * 0.8,
                pg=("3", "dp_group"),
            )
        for ln in lanes:
            rec = ln.event_record(S_DP, ln.tid_main)
            ln.stream_wait(S_COMP, rec, ln.tid_main)

    def run(self):
        cfg = self.cfg
        for step in range(cfg.steps):
            starts = {}
            for r, ln in self.lanes.items():
                starts[r] = ln.cpu
                ln.begin_step()
                ln.cpu_x(
                    "cpu_op",
                    "Optimizer.zero_grad#DistributedOptimizer.zero_grad",
                    ln.cpu,
                    40.0,
                    ln.tid_main,
                )
                ln.cpu += 42.0
            for g in range(self.dp // self.ep):
                self.pipeline(g)
            for s in range(self.pp):
                self.step_end(s)
            for r, ln in self.lanes.items():
                ln.ext += 1
                ln.cpu += 8.0
                ln.cpu_x(
                    "user_annotation",
                    "ProfilerStep#%d" % (cfg.first_step + step),
                    starts[r],
                    ln.cpu - starts[r],
                    ln.tid_main,
                )
                ln.cpu += 15.0
        counts = {}
        for r, ln in self.lanes.items():
            self.meta_events(ln)
            counts[r] = ln.w.close()
        return counts

    def meta_events(self, ln):
        base = self.cfg.base
        add = ln.w.add
        add(
            '{"name": "process_name", "ph": "M", "ts": %.3f, "pid": %d, "tid": 0, "args": {"name": "python3.11"}}'
            % (base, ln.pid)
        )
        add(
            '{"name": "process_labels", "ph": "M", "ts": %.3f, "pid": %d, "tid": 0, "args": {"labels": "CPU"}}'
            % (base, ln.pid)
        )
        add(
            '{"name": "process_name", "ph": "M", "ts": %.3f, "pid": %d, "tid": 0, "args": {"name": "python3.11"}}'
            % (base, ln.gpid)
        )
        add(
            '{"name": "process_labels", "ph": "M", "ts": %.3f, "pid": %d, "tid": 0, "args": {"labels": "GPU %d"}}'
            % (base, ln.gpid, ln.dev)
        )
        for st in (S_COMP, S_PP, S_EP, S_DP):
            add(
                '{"name": "thread_name", "ph": "M", "ts": %.3f, "pid": %d, "tid": %d, "args": {"name": "stream %d "}}'
                % (base, ln.gpid, st, st)
            )
        add(
            '{"name": "thread_name", "ph": "M", "ts": %.3f, "pid": %d, "tid": %d, "args": {"name": "thread %d (pt_main_thread)"}}'
            % (base, ln.pid, ln.tid_main, ln.tid_main)
        )
        add(
            '{"name": "thread_name", "ph": "M", "ts": %.3f, "pid": %d, "tid": %d, "args": {"name": "thread %d (pt_autograd_0)"}}'
            % (base, ln.pid, ln.tid_bwd, ln.tid_bwd)
        )
        add(
            '{"ph": "X", "cat": "Trace", "ts": %.3f, "dur": %.3f, "pid": "Spans", "tid": "PyTorch Profiler", "name": "PyTorch Profiler (0)", "args": {"Op count": 0}}'
            % (base, ln.cpu - base)
        )
        add(
            '{"name": "Iteration Start: PyTorch Profiler", "ph": "i", "s": "g", "pid": "Traces", "tid": "Trace PyTorch Profiler", "ts": %.3f}'
            % base
        )
        add(
            '{"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "", "ts": %.3f}'
            % ln.cpu
        )


# Calibrated (8 ranks, M=8, 3 steps): L=1 -> 11959..12739 events/rank, L=2 -> 22303..23083.
EVENTS_PER_LAYER_MB = 431  # events per (layer x micro-batch), forward + backward
EVENTS_OVERHEAD_PER_STEP = 540


def _union(iv):
    """Sorted, merged copy of a list of (start, end) intervals."""
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1][1] = b
        else:
            out.append([a, b])
    return out


def _overlap(x, y):
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            tot += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def ground_truth(sim):
    """Bubbles, step times and slow ranks as the simulator knows them (not read from the files)."""
    cfg = sim.cfg
    by_rank, step_time = {}, []
    # step time: from the end of the previous step's GPU work over all ranks (the first step:
    # from the earliest ProfilerStep start) to the end of this step's GPU work over all ranks
    prev = min(ln.truth[0]["start"] for ln in sim.lanes.values())
    for k in range(cfg.steps):
        t1 = max(ln.truth[k]["gpu_end"] for ln in sim.lanes.values())
        step_time.append(t1 - prev)
        prev = t1
    for r, ln in sim.lanes.items():
        rows = []
        for tr in ln.truth:
            w0 = min(tr["start"], tr["gpu_start"])
            win = [[w0, tr["gpu_end"]]]
            recv = _union(tr["recv"])
            comp = _union(tr["comp"])
            # idle-while-receiving = |recv ∩ window| - |recv ∩ compute|
            bubble = _overlap(recv, win) - _overlap(recv, comp)
            rows.append(
                {
                    "window_us": tr["gpu_end"] - w0,
                    "bubble_us": bubble,
                    "compute_us": sum(b - a for a, b in comp),
                }
            )
        by_rank[r] = rows
    stage_ratio = []
    for s in range(sim.pp):
        ranks = [sim.rank(s, d) for d in range(sim.dp)]
        ratios = [row["bubble_us"] / row["window_us"] for r in ranks for row in by_rank[r]]
        stage_ratio.append(sum(ratios) / len(ratios))
    return {
        "slow_ranks": sorted(cfg.slow_ranks),
        "slow_factor": cfg.slow_factor,
        "step_time_us": step_time,
        "bubble_ratio_by_stage": stage_ratio,
        "by_rank": {str(r): v for r, v in by_rank.items()},
    }


def build_parser():
    """The generator's command line."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument(
        "--pp", type=int, default=0, help="pipeline stages (default: 4 for <=32 ranks, else 8)"
    )
    ap.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: min(8, dp))")
    ap.add_argument(
        "--events", type=int, default=20000, help="target events per rank (sets --layers)"
    )
    ap.add_argument(
        "--layers", type=int, default=0, help="transformer layers per stage (overrides --events)"
    )
    ap.add_argument("--microbatches", type=int, default=0, help="default 2*pp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--first-step", type=int, default=10)
    ap.add_argument("--slow-ranks", default="", help="comma list; default: one rank in the middle")
    ap.add_argument("--slow-factor", type=float, default=1.3)
    ap.add_argument("--a2a-us", type=float, default=450.0)
    ap.add_argument("--p2p-us", type=float, default=300.0)
    ap.add_argument("--dp-us", type=float, default=4000.0)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--adam-kernels", type=int, default=12)
    ap.add_argument("--nccl-naming", choices=["modern", "legacy"], default="modern")
    ap.add_argument("--no-cuda-sync", action="store_true")
    ap.add_argument("--no-fwdbwd", action="store_true")
    ap.add_argument("--no-gzip", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def generate(argv):
    """Write one trace per rank into --out; return the info dict with its "truth"."""
    a = build_parser().parse_args(argv)
    pp = a.pp or (4 if a.ranks <= 32 else 8)
    pp = min(pp, a.ranks)
    assert a.ranks % pp == 0, "ranks must be a multiple of pp"
    dp = a.ranks // pp
    ep = a.ep or min(8, dp)
    assert dp % ep == 0, "dp must be a multiple of ep"
    M = a.microbatches or 2 * pp
    if a.layers:
        L = a.layers
    else:
        L = max(
            1, round((a.events / a.steps - EVENTS_OVERHEAD_PER_STEP) / (M * EVENTS_PER_LAYER_MB))
        )
    slow = (
        [int(x) for x in a.slow_ranks.split(",") if x]
        if a.slow_ranks
        else [a.ranks // 2 + 1 if a.ranks > 1 else 0]
    )

    class C:
        pass

    cfg = C()
    cfg.out, cfg.pp, cfg.dp, cfg.ep, cfg.layers, cfg.microbatches, cfg.steps = (
        a.out,
        pp,
        dp,
        ep,
        L,
        M,
        a.steps,
    )
    cfg.first_step, cfg.slow_ranks, cfg.slow_factor = a.first_step, set(slow), a.slow_factor
    cfg.a2a_us, cfg.p2p_us, cfg.dp_us, cfg.buckets, cfg.adam_kernels = (
        a.a2a_us,
        a.p2p_us,
        a.dp_us,
        a.buckets,
        a.adam_kernels,
    )
    cfg.nccl = NCCL_MODERN if a.nccl_naming == "modern" else NCCL_LEGACY
    cfg.cuda_sync, cfg.fwdbwd, cfg.gzip, cfg.seed = (
        not a.no_cuda_sync,
        not a.no_fwdbwd,
        not a.no_gzip,
        a.seed,
    )
    cfg.base = 5_000_000_000.0  # us
    t0 = time.time()
    sim = Sim(cfg)
    counts = sim.run()
    info = {
        "ranks": a.ranks,
        "pp": pp,
        "dp": dp,
        "ep": ep,
        "layers_per_stage": L,
        "microbatches": M,
        "steps": a.steps,
        "slow_ranks": slow,
        "slow_factor": a.slow_factor,
        "nccl_naming": a.nccl_naming,
        "events_per_rank_min": min(counts.values()),
        "events_per_rank_max": max(counts.values()),
        "events_total": sum(counts.values()),
        "gen_seconds": round(time.time() - t0, 1),
        "truth": ground_truth(sim),
    }
    return info


def main():
    """CLI: generate, write <out>.geninfo.json next to (not inside) the trace directory."""
    a = build_parser().parse_args()
    info = generate(None)
    with open(
        a.out.rstrip("/") + ".geninfo.json", "w"
    ) as f:  # outside the trace dir (HTA reads every *.json there)
        json.dump(info, f, indent=1)
    brief = {k: v for k, v in info.items() if k != "truth"}
    print(json.dumps(brief))


if __name__ == "__main__":
    main()
