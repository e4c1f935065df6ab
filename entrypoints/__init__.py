"""How hosts reach the Titan registry (installed as the ``titan_entrypoints`` package).

Nothing here runs on import: :mod:`torch_autoload` is the torch.backends entry point,
:mod:`titan_run` the launcher for environments where that channel is off.
"""
