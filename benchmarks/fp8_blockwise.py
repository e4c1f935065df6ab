"""Blockwise FP8 (plugin ``fp8_blockwise``): memory, emulation cost and loss gap vs a baseline.

Prints, each against a baseline measured in the same run:
1. bytes of activations saved for backward, FP8 vs bf16: per linear layer, and per transformer
   layer of a bf16 MoE GPT built by unmodified megatron-core (plugin on vs off); goal <= 0.55x
   for what FP8 controls (the GEMM inputs);
2. CPU emulation throughput (quantize, GEMM, a linear layer forward+backward) vs fp32/bf16
   (informational: CPUs have no FP8 GEMM);
3. the relative loss gap FP8 vs fp32 of the tiny MoE GPT over 100 steps (world size 1);
4. ``--section gpu`` (CUDA; ``--gpu-smoke`` runs it tiny on CPU): the quantizer on the device
   bit-identical to the CPU reference, linear-layer step time FP8 vs bf16, whether the
   block-scaled ``torch._scaled_mm`` kernel was verified, and whether TransformerEngine's
   Float8BlockScaling recipe is importable there (the plugin then uses it).

Usage: python benchmarks/fp8_blockwise.py [--section cpu|gpu|all] [--size 1024] [--reps 5]
       [--skip-megatron] [--gpu-smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import loadguard
import torch
import torch.nn.functional as F
from titan_fp8_blockwise import gemm as gemm_mod
from titan_fp8_blockwise.linear import fp8_linear
from titan_fp8_blockwise.quantize import quantize_blocks, quantize_tiles


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _saved_bytes(run, params=()) -> int:
    """Bytes autograd saves while ``run()`` builds its graph, excluding parameters.

    Counted per storage (views of one tensor count once); a tensor sharing storage with a
    parameter (e.g. the transposed weight F.linear saves) is a parameter, not an activation.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages and not isinstance(t, torch.nn.Parameter):
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def linear_memory(tokens: int, hidden: int) -> None:
    """Saved bytes of one linear layer: fp8_linear vs bf16 F.linear (bytes: no load verdict)."""
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(hidden, hidden, dtype=torch.bfloat16))
    bf16 = _saved_bytes(lambda: F.linear(x, w), [w])
    fp8 = _saved_bytes(lambda: fp8_linear(x, w), [w])
    met = "met" if fp8 / bf16 <= 0.55 else "NOT met"
    print(
        f"[memory] linear {tokens}x{hidden}: bf16 {bf16} B, fp8 {fp8} B -> {fp8 / bf16:.3f}x "
        f"(goal <= 0.55x: {met})"
    )


def emulation_throughput(n: int, reps: int) -> None:
    """CPU cost of the emulation vs fp32 / bf16 matmul at n x n x n."""
    x, w = torch.randn(n, n), torch.randn(n, n) * 0.02
    xb, wb = x.bfloat16(), w.bfloat16()
    qx, qw = quantize_tiles(xb), quantize_blocks(wb)
    t = {
        "fp32 matmul": _median_s(lambda: x @ w.t(), reps),
        "bf16 matmul": _median_s(lambda: xb @ wb.t(), reps),
        "quantize 1x128 (bf16 in)": _median_s(lambda: quantize_tiles(xb), reps),
        "quantize 128x128 (bf16 in)": _median_s(lambda: quantize_blocks(wb), reps),
        "fp8 GEMM emulation (dequant + fp32)": _median_s(lambda: gemm_mod.gemm(qx, qw), reps),
    }
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    t["fp32 linear fwd+bwd"] = _median_s(lambda: F.linear(xg, wg).sum().backward(), reps)
    t["fp8 linear fwd+bwd (emulated)"] = _median_s(
        lambda: fp8_linear(xg, wg).sum().backward(), reps
    )
    base = t["fp32 matmul"]
    for name, sec in t.items():
        print(f"[cpu {n}^3] {name:40s} {sec * 1e3:9.1f} ms  {sec / base:6.2f}x fp32 matmul")
    ratio = t["fp8 linear fwd+bwd (emulated)"] / t["fp32 linear fwd+bwd"]
    print(f"[cpu {n}^3] linear fwd+bwd: fp8 emulation / fp32 = {ratio:.2f}x (informational)")
    print(f"[cpu {n}^3] {loadguard.describe()}")


def _layer_saved_task(fp8: bool, swiglu: bool) -> dict:
    """Gloo worker task: saved bytes of decoder layer 0 of a bf16 MoE GPT (plugin on/off).

    ``swiglu``: DeepSeek-style experts (SwiGLU, fused bias-activation); with ``fp8`` the SwiGLU
    input is also stored in FP8 (megatron's activation_func_fp8_input_store, blockwise here).
    """
    import contextlib

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing.activation import plugin_active

    tiny_gpt.init_parallel()
    active = plugin_active("fp8_blockwise", {}) if fp8 else contextlib.nullcontext()
    with active:
        from megatron.core.fp8_utils import get_fp8_context

        flags = {"fp8": "e4m3", "fp8_recipe": "blockwise"} if fp8 else {}
        if swiglu:
            flags.update(gated_linear_unit=True, bias_activation_fusion=True)
            flags.update(activation_func=torch.nn.functional.silu)
            flags["activation_func_fp8_input_store"] = fp8
        cfg = tiny_gpt.make_config(
            hidden_size=512,
            ffn_hidden_size=1024,
            moe_ffn_hidden_size=1024,
            num_attention_heads=8,
            bf16=True,
            params_dtype=torch.bfloat16,
            **flags,
        )
        layer = tiny_gpt.build_model(cfg, ddp=False)[0].decoder.layers[0]
        params = list(layer.parameters())
        hidden = torch.randn(128, 8, 512, dtype=torch.bfloat16, requires_grad=True)
        normed = layer.pre_mlp_layernorm(hidden).detach().requires_grad_()

        def measured(fn):
            def run():
                with get_fp8_context(cfg, 0) if fp8 else contextlib.nullcontext():
                    fn()

            return _saved_bytes(run, params)

        return {
            "layer": measured(lambda: layer(hidden, attention_mask=None)),
            "attention": measured(lambda: layer.self_attention(hidden, attention_mask=None)),
            "moe": measured(lambda: layer.mlp(normed)),
        }


def layer_memory() -> None:
    """Saved bytes of a transformer (MoE) layer built by megatron, plugin on vs off."""
    from titan_plugins.testing.workers import GlooWorkerPool

    with GlooWorkerPool(1) as pool:
        for swiglu, what in ((False, "GELU experts"), (True, "SwiGLU experts, FP8 SwiGLU input")):
            off = pool.run(_layer_saved_task, False, swiglu)[0]
            on = pool.run(_layer_saved_task, True, swiglu)[0]
            for part in ("layer", "attention", "moe"):
                print(
                    f"[memory] {part:9s} bf16 MoE layer, 8x128 tokens, hidden 512, 4 experts "
                    f"top-2, {what}: bf16 {off[part]} B, fp8 {on[part]} B -> "
                    f"{on[part] / off[part]:.3f}x"
                )


def _gap_task(fp8: bool, steps: int) -> list[float]:
    import contextlib

    from titan_plugins.hosts.megatron.testing import tiny_gpt
    from titan_plugins.testing.activation import plugin_active

    tiny_gpt.init_parallel()
    active = plugin_active("fp8_blockwise", {}) if fp8 else contextlib.nullcontext()
    with active:
        flags = {"fp8": "e4m3", "fp8_recipe": "blockwise"} if fp8 else {}
        cfg = tiny_gpt.make_config(**flags)
        chunks = tiny_gpt.build_model(cfg)
        return tiny_gpt.train(chunks, cfg, steps, num_microbatches=1, lr=3e-4)[0]


def loss_gap(steps: int = 100) -> None:
    """Relative loss gap FP8 vs fp32, tiny MoE GPT, world size 1, fixed data."""
    from titan_plugins.testing.workers import GlooWorkerPool

    with GlooWorkerPool(1) as pool:
        ref = pool.run(_gap_task, False, steps)[0]
        fp8 = pool.run(_gap_task, True, steps)[0]
    gaps = [abs(a - b) / b for a, b in zip(fp8, ref, strict=True)]
    print(
        f"[loss] {steps} steps, loss {ref[0]:.3f} -> {ref[-1]:.3f} (fp32) / {fp8[-1]:.3f} (fp8): "
        f"relative gap mean {100 * sum(gaps) / len(gaps):.3f}%, max {100 * max(gaps):.3f}%, "
        f"last step {100 * gaps[-1]:.3f}%"
    )


def gpu_section(smoke: bool, reps: int = 20) -> None:
    """CUDA (or tiny on CPU with ``smoke``): device quantizer vs the CPU reference bit for bit,
    linear fwd+bwd step time FP8 vs bf16 at a Kimi-K2-like shape, TE availability."""
    import gpu_check

    from titan_plugins import platform

    if not smoke and not torch.cuda.is_available():
        print("[gpu] skipped: CUDA is not available (run on a GPU machine, or --gpu-smoke)")
        return
    dev = torch.device("cpu" if smoke else "cuda")
    tokens, hidden, ffn = (256, 256, 128) if smoke else (8192, 7168, 2048)
    sample = torch.randn(1024 if smoke else 4096, 1024, generator=torch.Generator().manual_seed(0))
    sample[0, :128] = 0.0  # an all-zero tile: scale 1
    identical = True
    for quantize in (quantize_tiles, quantize_blocks):
        ref = quantize(sample)
        got = quantize(sample.to(dev))
        identical &= torch.equal(ref.data.view(torch.uint8), got.data.cpu().view(torch.uint8))
        identical &= torch.equal(ref.scale_inv, got.scale_inv.cpu())
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(ffn, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def timed(fn) -> float:
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        return _median_s(lambda: (fn(), sync()), 3 if smoke else reps)

    bf16 = timed(lambda: F.linear(x, w).sum().backward())
    fp8 = timed(lambda: fp8_linear(x, w).sum().backward())
    layouts = dict(gemm_mod._VERIFIED)
    te = platform.probe_te_blockwise()
    print(
        f"[gpu] {dev}: quantizer bit-identical to the CPU reference: {identical}; linear "
        f"{tokens}x{hidden}->{ffn} fwd+bwd: bf16 {bf16 * 1e3:.2f} ms, fp8 {fp8 * 1e3:.2f} ms "
        f"-> {fp8 / bf16:.2f}x; verified _scaled_mm layouts: {layouts}; TE: {te.detail}"
    )
    gpu_check.emit(
        {
            "quantizer_bit_identical": bool(identical),
            "bf16_ms": bf16 * 1e3,
            "fp8_ms": fp8 * 1e3,
            "fp8_over_bf16": fp8 / bf16,
            "scaled_mm_layouts": len(layouts),
            "te_blockwise": te.available,
        }
    )


def main() -> None:
    """Run every section (megatron sections unless --skip-megatron; GPU if CUDA is there)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="n for the n^3 CPU GEMMs")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--section", choices=("cpu", "gpu", "all"), default="all")
    parser.add_argument("--gpu-smoke", action="store_true", help="run [gpu] tiny on CPU")
    loadguard.add_arguments(parser)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(loadguard.describe(args))
    if args.section in ("cpu", "all"):
        linear_memory(4096, 1024)
        emulation_throughput(args.size, args.reps)
        if not args.skip_megatron:
            layer_memory()
            loss_gap()
    if args.section in ("gpu", "all"):
        gpu_section(args.gpu_smoke)
    print(loadguard.describe(args))  # the load at the end too: timings drift with it


if __name__ == "__main__":
    main()
