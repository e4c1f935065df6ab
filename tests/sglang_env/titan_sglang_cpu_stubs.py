"""Import stubs for SGLang on a CPU-only test machine (the SGLang venv of the tests only: never
shipped in a distribution; scripts/sglang_env.sh puts a ``.pth`` line that imports this module).

SGLang 0.5.23 imports two packages at start-up that have no CPU build on the registry, and whose
code a CPU engine never runs (shared/research/rl_rollout.md §1.2):

- ``torchvision`` (``srt/multimodal/internvl_utils.py``): PyPI's wheel is CUDA-built and fails
  to import beside the CPU torch (``operator torchvision::nms does not exist``);
- ``sgl_kernel`` (``srt/mem_cache/memory_pool.py`` via ``kernels/ops/kvcache``): PyPI's
  ``sglang-kernel`` holds only sm90 / sm100 builds.

Each import of those packages gets an empty stand-in module whose attributes are mocks. A
text-only model on ``SGLANG_USE_CPU_ENGINE=1`` with the ``torch_native`` attention backend
never calls them (the engine's greedy tokens equal HF transformers', checked by the tests).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from unittest import mock

STUBBED = ("torchvision", "sgl_kernel")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):  # noqa: D102
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: D102
        module = mock.MagicMock(name=spec.name)
        module.__path__ = []
        module.__spec__ = spec
        module.__name__ = spec.name
        return module

    def exec_module(self, module):  # noqa: D102
        pass


if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())
