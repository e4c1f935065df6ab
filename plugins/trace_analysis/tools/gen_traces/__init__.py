"""Synthetic multi-rank Kineto traces of a Megatron-style MoE job, with ground truth.

Not part of any installed distribution: it is the analyzer's test oracle (an independent model
of the schedule).  Modules: :mod:`.catalogue` (kernel names, recipes), :mod:`.lanes` (one rank's
clocks and events), :mod:`.simulator` and :mod:`.schedule` (the job), :mod:`.truth` (ground
truth), :mod:`.cli` (command line).  Use ``generate([...argv])`` from Python.
"""

from .cli import generate, main

__all__ = ["generate", "main"]
