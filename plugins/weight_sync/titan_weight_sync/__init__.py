"""Titan plugin weight_sync: trained weights from Megatron into SGLang rollout engines, written
one-sided over Mooncake and loaded all or nothing. Importing this package has no side effect.

Trainer side: :class:`titan_weight_sync.trainer_side.WeightSync` and
:func:`titan_weight_sync.megatron_export.gather_hf_weights`; engine side: the patch in
:mod:`titan_weight_sync.patches`, active in every SGLang process where the plugin is installed.
"""

from .version import __version__ as __version__
