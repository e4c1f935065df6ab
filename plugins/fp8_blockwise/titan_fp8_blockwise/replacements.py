"""The plugin's replacement functions, applied while megatron imports (one module, so the plugin
loads few modules then: tests/test_import_budget.py).

- ``ColumnParallelLinear`` / ``RowParallelLinear._forward_impl``, per line. Megatron calls
  ``self._forward_impl(input=..., weight=..., **keywords)`` and passes the keywords on to
  ``linear_with_grad_accumulation_and_async_allreduce``. The keywords changed across lines: 0.16
  still accepts the unused ``async_grad_allreduce``; 0.19 adds ``gtp_remat_size`` (weights sharded
  by Generalized Tensor Parallelism, gathered just before the GEMM). Each variant knows the
  keywords of the lines it is gated on; a keyword it does not know (a line or fork it was not
  written for) sends the call to megatron's own path with one warning, instead of dropping it.
- Megatron without TransformerEngine: the replacements that let an FP8 model build and train.

Light: the FP8 linear, the backend and megatron load inside the replacements, at their first
call (after megatron has imported).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from titan_fp8_blockwise import region, settings
from titan_plugins.patching import MISSING


def _backend() -> Any:
    """The backend module, loaded at the first call (after megatron has imported), so that
    applying the patches loads few modules."""
    from titan_fp8_blockwise import backend

    return backend


logger = logging.getLogger("titan_plugins.fp8_blockwise")

KEYWORDS = frozenset(
    ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel")
    + ("grad_output_buffer", "wgrad_deferral_limit", "tp_group", "async_grad_allreduce")
)
"""What megatron 0.16-0.18 pass (``wgrad_deferral_limit`` only matters with a
``grad_output_buffer``, which keeps megatron's path; ``async_grad_allreduce`` is unused)."""
GTP_KEYWORDS = KEYWORDS | {"gtp_remat_size"}
"""0.19: plus the GTP shard count of the weight (1: not sharded)."""

_warned: set[frozenset[str]] = set()


def _warn_unknown(unknown: frozenset[str]) -> None:
    if unknown in _warned:
        return
    _warned.add(unknown)
    logger.warning(
        "fp8_blockwise: megatron passes %s to the linear layers' _forward_impl, which this "
        "plugin version does not know; those layers run megatron's own (high-precision) path. "
        "Fix: a titan-fp8-blockwise release that serves this Megatron",
        ", ".join(sorted(unknown)),
    )


def wrap_forward_impl(kind: str, known: frozenset[str]) -> Callable[[Any], Callable[..., Any]]:
    """The patch factory for ``{kind}._forward_impl`` on lines whose keywords are ``known``."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        head_in_fp8 = "output_head" not in settings.high_precision()

        @functools.wraps(original)
        def _forward_impl(self: Any, input: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
            recipe = region.current()
            if recipe is None and head_in_fp8:  # linears outside transformer layers: the head
                recipe = _backend().recipe_for(self.config)
            if (
                recipe is None
                or args  # megatron passes keywords; anything else is not a call we know
                or not weight.requires_grad  # frozen weights keep megatron's own path
                or kwargs.get("grad_output_buffer") is not None  # deferred embedding wgrad
            ):
                return original(self, input, weight, *args, **kwargs)
            unknown = frozenset(kwargs) - known
            if unknown:
                _warn_unknown(unknown)
                return original(self, input, weight, *args, **kwargs)
            region.count(kind + (".expert" if getattr(self, "is_expert", False) else ""))
            tp_group = kwargs.get("tp_group")
            needs_group = kwargs.get("sequence_parallel") or kwargs.get("allreduce_dgrad")
            if tp_group is None and needs_group:
                from megatron.core import parallel_state

                tp_group = parallel_state.get_tensor_model_parallel_group()
            from titan_fp8_blockwise.linear import fp8_linear

            return fp8_linear(
                input,
                weight,
                kwargs.get("bias"),
                recipe,
                sequence_parallel=bool(kwargs.get("sequence_parallel")),
                allreduce_dgrad=bool(kwargs.get("allreduce_dgrad")),
                tp_group=tp_group,
                gradient_accumulation_fusion=bool(kwargs.get("gradient_accumulation_fusion")),
                gtp_remat_size=int(kwargs.get("gtp_remat_size") or 1),
            )

        return _forward_impl

    return factory


def wrap_te_checkpoint(original: Any) -> Callable[..., Any]:
    """te_checkpoint: TE's when the TE backend serves, else megatron's own checkpoint with the
    FP8 region re-opened for the recomputation."""

    def te_checkpoint(
        forward_func: Callable[..., Any],
        distribute_saved_activations: bool,
        get_rng_state_tracker: Any,
        tp_group: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if original not in (None, MISSING) and _backend().resolve_backend() == "te":
            return original(
                forward_func,
                distribute_saved_activations,
                get_rng_state_tracker,
                tp_group,
                *args,
                **kwargs,
            )
        from megatron.core import tensor_parallel

        recipe = region.current()

        def run(*inputs: Any) -> Any:
            # The recomputation in backward happens outside the caller's FP8 region: re-open it.
            with region.fp8_region(recipe):
                return forward_func(*inputs, **kwargs)

        return tensor_parallel.checkpoint(run, distribute_saved_activations, *args)

    return te_checkpoint


def te_general_gemm(original: Any) -> Any:
    """0.16 without TE: megatron's torch path (None) instead of an unbound name."""

    return None if original is MISSING else original


def wrap_is_te_min_version(original: Callable[..., Any]) -> Callable[..., Any]:
    """is_te_min_version that answers the MoE-FP8 check itself when TE does not import."""

    @functools.wraps(original)
    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        # Whether transformer_engine imports, as megatron decides it (fp8_utils.HAVE_TE). Not
        # get_te_version(): None without TE up to 0.16, PkgVersion("0.0.0") from 0.17.
        from megatron.core import fp8_utils

        if fp8_utils.HAVE_TE:
            return original(version, check_equality)
        # No TE: the MoE FP8 check (TE >= 1.7 handles zero-token experts) is served by the
        # plugin's layers; any other TE feature is simply absent (0.16: instead of a TypeError).
        return version == "1.7.0.dev0"

    return is_te_min_version
