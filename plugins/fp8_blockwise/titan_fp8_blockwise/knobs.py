"""The plugin's environment knobs, read lazily (at activation or call time)."""

from __future__ import annotations

from titan_plugins.settings import Setting, complain, env_bool, env_choice, env_list

FORCE = "TITAN_FP8_BLOCKWISE_FORCE"
BACKEND = "TITAN_FP8_BLOCKWISE_BACKEND"
SCALES = "TITAN_FP8_BLOCKWISE_SCALES"
HIGH_PRECISION = "TITAN_FP8_BLOCKWISE_HIGH_PRECISION"

BACKENDS = ("auto", "te", "torch")
SCALE_CHOICES = ("pow2", "fp32", "deepseek")
# DeepSeek-V3 keeps these in BF16/FP32. Embedding and norms have no GEMM: always high precision.
HIGH_PRECISION_PARTS = ("embedding", "output_head", "router", "norms")
DEFAULT_HIGH_PRECISION = HIGH_PRECISION_PARTS

SETTINGS = [
    Setting(
        FORCE,
        "0",
        "1: train in blockwise FP8 as if --fp8-format e4m3 --fp8-recipe "
        "blockwise were passed (for hosts that cannot pass flags)",
    ),
    Setting(
        BACKEND,
        "auto",
        "auto: TransformerEngine's Float8BlockScaling when TE has it, "
        "else the plugin's pure-torch layers; te: require TE (warn and fall back, error "
        "under TITAN_PLUGINS_STRICT=1); torch: always the plugin's layers",
        BACKENDS,
    ),
    Setting(
        SCALES,
        "pow2",
        "scale rule: pow2 (TE default, 448/amax floored to a power of "
        "two), fp32 (448/amax), deepseek (scale_inv = amax/448)",
        SCALE_CHOICES,
    ),
    Setting(
        HIGH_PRECISION,
        ",".join(DEFAULT_HIGH_PRECISION),
        "parts kept out of FP8 "
        "(comma list of embedding, output_head, router, norms); drop output_head / router "
        "to run those GEMMs in FP8 too",
    ),
]


def force() -> bool:
    """TITAN_FP8_BLOCKWISE_FORCE: blockwise FP8 without megatron's fp8 flags."""
    return env_bool(FORCE, False)


def backend_choice() -> str:
    """TITAN_FP8_BLOCKWISE_BACKEND: auto | te | torch."""
    return env_choice(BACKEND, BACKENDS, "auto")


def scales() -> str:
    """TITAN_FP8_BLOCKWISE_SCALES: pow2 | fp32 | deepseek."""
    return env_choice(SCALES, SCALE_CHOICES, "pow2")


def high_precision() -> frozenset[str]:
    """TITAN_FP8_BLOCKWISE_HIGH_PRECISION as a set (unknown names warn, or raise under STRICT)."""
    parts = env_list(HIGH_PRECISION, DEFAULT_HIGH_PRECISION)
    unknown = [p for p in parts if p not in HIGH_PRECISION_PARTS]
    if unknown:
        complain(
            f"{HIGH_PRECISION}: unknown part(s) {', '.join(unknown)}; accepted: "
            f"{', '.join(HIGH_PRECISION_PARTS)} (ignored)"
        )
    # Embedding lookups and norms are not GEMMs: they stay high precision whatever the list says.
    return frozenset(p for p in parts if p in HIGH_PRECISION_PARTS) | {"embedding", "norms"}
