"""The ``torch.backends`` entry point: PyTorch >= 2.5 calls :func:`autoload` at the end of
every ``import torch``.

If this function raised, ``import torch`` would fail in every process of the environment, so
it catches everything. It imports no megatron and nothing but the standard library: it arms a
one-shot import trigger (:mod:`titan_plugins.autoload`); the plugins load when ``megatron`` is
first imported.
"""

from __future__ import annotations


def autoload() -> None:
    """Arm the registry for this process. Never raises."""
    try:
        from titan_plugins.autoload import arm

        arm("torch.backends")
    except Exception as err:  # pragma: no cover - only reached with a broken install
        import sys

        print(
            f"[titan_plugins] WARNING autoload unavailable ({type(err).__name__}: {err}); "
            "set TITAN_PLUGINS_DEBUG=1 for details",
            file=sys.stderr,
        )
