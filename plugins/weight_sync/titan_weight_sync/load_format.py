"""The ``load_format`` that marks this plugin's requests: a leaf both sides read.

Its own module so that the messages (:mod:`titan_weight_sync.wire`) and the patch records
(:mod:`titan_weight_sync.patches`, which reach both the engine and the trainer side) share it
without importing each other in a circle.
"""

from __future__ import annotations

LOAD_FORMAT = "titan_weight_sync"
"""The ``load_format`` of SGLang's ``update_weights_from_tensor`` requests that carry this
plugin's messages (:mod:`titan_weight_sync.wire`)."""
