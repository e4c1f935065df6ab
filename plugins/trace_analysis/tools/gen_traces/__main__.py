"""``python -m gen_traces`` (run with plugins/trace_analysis/tools on sys.path)."""

from .cli import main

main()
