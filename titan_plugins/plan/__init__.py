"""Memory / FLOPs planner for Megatron-LM launches (``titan-plugins plan``).

Pure Python: reads Megatron-LM flags (or a launch script), never imports megatron or torch.
Entry point: ``titan_plugins.plan.cli.main(argv) -> int``.
"""
