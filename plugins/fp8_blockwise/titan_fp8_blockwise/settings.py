"""The plugin's knobs (``TITAN_FP8_BLOCKWISE_*``), declared once and read through ``Setting.read``.

Light on purpose: the core reads :data:`SETTINGS` at activation, while Megatron is importing.
"""

from __future__ import annotations

from titan_plugins.settings import Setting

BACKENDS = ("auto", "te", "torch")
SCALE_CHOICES = ("pow2", "fp32", "deepseek")
# DeepSeek-V3 keeps these in BF16/FP32. Embedding and norms have no GEMM: always high precision.
HIGH_PRECISION_PARTS = ("embedding", "output_head", "router", "norms")

FORCE = Setting(
    "TITAN_FP8_BLOCKWISE_FORCE",
    bool,
    False,
    "1: train in blockwise FP8 as if --fp8-format e4m3 --fp8-recipe blockwise were passed "
    "(for hosts that cannot pass flags)",
)
BACKEND = Setting(
    "TITAN_FP8_BLOCKWISE_BACKEND",
    str,
    "auto",
    "auto: TransformerEngine's Float8BlockScaling when TE has it, else the plugin's pure-torch "
    "layers; te: require TE (warn and fall back, error under TITAN_PLUGINS_STRICT=1); torch: "
    "always the plugin's layers",
    choices=BACKENDS,
)
SCALES = Setting(
    "TITAN_FP8_BLOCKWISE_SCALES",
    str,
    "pow2",
    "scale rule: pow2 (TE default, 448/amax floored to a power of two), fp32 (448/amax), "
    "deepseek (scale_inv = amax/448)",
    choices=SCALE_CHOICES,
)
HIGH_PRECISION = Setting(
    "TITAN_FP8_BLOCKWISE_HIGH_PRECISION",
    list,
    HIGH_PRECISION_PARTS,
    "parts kept out of FP8 (comma list of embedding, output_head, router, norms); drop "
    "output_head / router to run those GEMMs in FP8 too",
    choices=HIGH_PRECISION_PARTS,
)

SETTINGS = [FORCE, BACKEND, SCALES, HIGH_PRECISION]


def high_precision() -> frozenset[str]:
    """The parts kept out of FP8: ``TITAN_FP8_BLOCKWISE_HIGH_PRECISION`` plus embedding and
    norms (lookups and norms are not GEMMs: they stay high precision whatever the list says)."""
    return frozenset(HIGH_PRECISION.read()) | {"embedding", "norms"}
