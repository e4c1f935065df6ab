"""Which tensors saved for backward are activations: a contract between plugins.

An offloader (``act_offload``) sees every tensor autograd saves through
``torch.autograd.graph.saved_tensors_hooks`` and must tell *activations* (made by this forward,
dead after its backward: worth moving off the device) from parameters, model inputs, constants
and caches (never to be touched). A tensor with a ``grad_fn`` was made by the forward. A tensor
made inside a custom ``torch.autograd.Function.forward`` has no ``grad_fn`` (that forward runs
without grad), although it is just as much an activation: e.g. ``fp8_blockwise``'s FP8 copy of
a linear layer's input and its scales. The plugin that saves such a tensor marks it::

    from titan_plugins.saved_tensors import mark_activation

    ctx.save_for_backward(mark_activation(q.data), mark_activation(q.scale_inv))

and an offloader asks :func:`is_activation` in its pack hook.

By marking a tensor, its owner promises that:

* it is not a parameter or a view of one, and nothing modifies it in place after it is saved;
* the backward may receive, instead of the saved object, a copy with the same values bit for
  bit, and the same size, stride, dtype and device (so it must not rely on the object's
  identity, on attributes set on it, or on storage shared with other tensors).

The mark is an attribute of the Python tensor object (cheap, no registry to clean up): mark the
very object passed to ``save_for_backward``; views and ``detach()`` copies are not marked.
Importing this module imports nothing (it runs while Megatron loads).
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")
_MARK = "_titan_saved_activation"


def mark_activation(tensor: T) -> T:
    """Declare ``tensor`` an activation an offloader may move (see the module docstring).

    :param tensor: a tensor about to be saved for backward; None is passed through.
    :return: the same tensor, so the call can wrap the argument of ``save_for_backward``.
    """
    if tensor is not None:
        try:
            setattr(tensor, _MARK, True)
        except (AttributeError, RuntimeError):  # a subclass without instance attributes
            pass
    return tensor


def is_activation(tensor: Any) -> bool:
    """Whether a saved ``tensor`` was made by the forward: it has a ``grad_fn`` or its owner
    marked it with :func:`mark_activation`.

    Views of parameters also have a ``grad_fn``: an offloader still checks storages.
    """
    return getattr(tensor, "grad_fn", None) is not None or getattr(tensor, _MARK, False) is True
