"""Produce HTA 0.5.0's temporal breakdown of each given trace (each alone in a trace_dir).

Run with HTA's own venv, not the project's (see ORIGIN.md):
``python make_hta_fixture.py DIR FILE... > out.json``.  Prints JSON; the test fixture
``hta_0.5.0_temporal.json`` keeps the per-file rows of that output.
"""

import json
import logging
import os
import shutil
import sys
import tempfile
from importlib.metadata import version


def main() -> None:
    """Temporal breakdown of every FILE under DIR, as HTA's defaults compute it."""
    from hta.trace_analysis import TraceAnalysis

    logging.disable(logging.WARNING)
    root, files = sys.argv[1], sys.argv[2:]
    out = {}
    for f in files:
        tmp = tempfile.mkdtemp()
        shutil.copy(os.path.join(root, f), os.path.join(tmp, os.path.basename(f)))
        try:
            df = TraceAnalysis(trace_dir=tmp).get_temporal_breakdown(visualize=False)
            rows = df.to_dict(orient="records")
            out[f] = [
                {k: v if isinstance(v, str) else float(v) for k, v in r.items()} for r in rows
            ]
        except Exception as exc:  # report and go on: one broken file must not hide the rest
            out[f] = {"error": f"{type(exc).__name__}: {exc}"}
        shutil.rmtree(tmp)
    print(json.dumps({"hta_version": version("HolisticTraceAnalysis"), "results": out}, indent=1))


if __name__ == "__main__":
    main()
