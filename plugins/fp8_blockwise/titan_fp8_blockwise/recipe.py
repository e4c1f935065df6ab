"""What to quantize to: the FP8 formats and scale rule of one training run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_fp8_blockwise.quantize import SCALE_MODES


@dataclass(frozen=True)
class BlockwiseRecipe:
    """The blockwise FP8 recipe (TE ``Float8BlockScaling`` defaults).

    :param fwd_dtype: format of activations and weights (E4M3).
    :param bwd_dtype: format of gradients: E4M3 (DeepSeek-V3, ``fp8="e4m3"``) or E5M2
        (``fp8="hybrid"``).
    :param scales: ``"pow2"`` (TE default), ``"fp32"`` or ``"deepseek"`` (amax / 448).
    """

    fwd_dtype: torch.dtype = torch.float8_e4m3fn
    bwd_dtype: torch.dtype = torch.float8_e4m3fn
    scales: str = "pow2"

    def __post_init__(self) -> None:
        if self.scales not in SCALE_MODES:
            raise ValueError(f"scales={self.scales!r}: choose one of {SCALE_MODES}")

    @classmethod
    def from_format(cls, fp8_format: str | None, scales: str = "pow2") -> BlockwiseRecipe:
        """Recipe for megatron's ``config.fp8`` value (``"e4m3"`` or ``"hybrid"``)."""
        if fp8_format in (None, "e4m3", True):
            return cls(scales=scales)
        if fp8_format == "hybrid":
            return cls(bwd_dtype=torch.float8_e5m2, scales=scales)
        raise ValueError(
            f"fp8 format {fp8_format!r} is not usable with blockwise scaling: use 'e4m3' or "
            "'hybrid' (TE's Float8BlockScaling rejects pure E5M2)"
        )
