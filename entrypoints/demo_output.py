"""What the CPU demo prints and writes after training: the plugin report, the effects table,
the JSON report and the trace analyzer's summary (rank 0 only)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any


def effects_table(per_rank: list[dict[str, dict[str, Any]]]) -> str:
    """One row per plugin and measure, one column per rank: what each plugin did, counted."""
    rows: list[tuple[str, str]] = []
    for effects in per_rank:
        for plugin, measures in (effects or {}).items():
            for key in measures:
                if (plugin, key) not in rows:
                    rows.append((plugin, key))
    ranks = [f"rank {r}" for r in range(len(per_rank))]
    cells = [
        [_cell((per_rank[r] or {}).get(plugin, {}).get(key)) for r in range(len(per_rank))]
        for plugin, key in rows
    ]
    width = max([len(c) for row in cells for c in row] + [len(r) for r in ranks] + [6])
    name_w = max([len(p) for p, _ in rows] + [6])
    key_w = max([len(k) for _, k in rows] + [7])
    lines = ["", "what each plugin did (measured on every rank after training):"]
    lines.append(f"  {'plugin':<{name_w}}  {'measure':<{key_w}}  " + "  ".join(
        f"{r:>{width}}" for r in ranks
    ))  # fmt: skip
    for (plugin, key), row in zip(rows, cells):
        lines.append(f"  {plugin:<{name_w}}  {key:<{key_w}}  " + "  ".join(
            f"{c:>{width}}" for c in row
        ))  # fmt: skip
    if not rows:
        lines.append("  (no plugin reported an effect)")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_report(path: str, effects: list[Any], data: dict) -> bool:
    """Write every rank's effects and rank 0's registry report to ``path`` as strict JSON.

    Written to a temporary file first and renamed, so a failure never leaves a truncated report;
    returns False (after one line saying why) instead of raising: the training is done and the
    trace summary still follows.
    """
    from titan_plugins.jsonable import jsonable

    target = os.path.abspath(path)
    partial = f"{target}.partial"
    try:
        text = json.dumps(
            {"effects_per_rank": jsonable(effects), "report": jsonable(data)},
            indent=2,
            allow_nan=False,
        )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(partial, "w") as out:
            out.write(text + "\n")
        os.replace(partial, target)
    except (OSError, TypeError, ValueError) as err:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        print(f"report not written to {path}: {type(err).__name__}: {err}", flush=True)
        return False
    print(f"report written to {path}", flush=True)
    return True


def trace_summary(trace_dir: str) -> str:
    """The analyzer's summary of the captured steps, through the plugin's public command (the
    core never imports a plugin); never raises: the run is done."""
    import shutil
    import subprocess
    import sys

    command = shutil.which("titan-trace") or os.path.join(
        os.path.dirname(sys.executable), "titan-trace"
    )
    out_dir = os.path.join(os.path.dirname(os.path.abspath(trace_dir)), "trace_report")
    html = os.path.join(out_dir, "report.html")
    before = _stamp(html)
    try:
        done = subprocess.run(
            [command, "analyze", trace_dir, "--out", out_dir],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"trace analysis unavailable ({type(err).__name__}: {err})"
    text = (done.stdout + done.stderr).rstrip()
    # Named only when this analysis wrote it (a partial one, exit 3, writes it too): an older
    # run's report may lie there. The file's stamp is compared rather than the file deleted
    # first (the folder may be the user's, next to their own TITAN_TRACE_DIR) or its mtime
    # compared with a clock (coarse timestamps, a shared file system's clock).
    after = _stamp(html)
    if after is not None and after != before:
        text += f"\nHTML report: {html}"
    return "\ntrace analysis of the captured steps (titan-trace analyze):\n" + text


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is written anew (inode, size, mtime in ns); None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def print_report(data: dict) -> None:
    """The registry report, one line per plugin: state, patches applied, and where a plugin says
    it stands aside in this job's layout (its report's ``inactive_reason``), why."""
    print(f"titan-plugins {data['core_version']}: active via {data['channel']}", flush=True)
    megatron = data.get("megatron") or {}
    if megatron:
        print(f"  megatron: {megatron.get('summary')}", flush=True)
    for plugin in data["plugins"]:
        applied = sum(p["status"] == "applied" for p in plugin["patches"])
        # Records written for another Megatron line are by design, not missing patches.
        here = [p for p in plugin["patches"] if p["status"] != "other line"]
        why = f" ({plugin['reason']})" if plugin["reason"] else ""
        print(
            f"  {plugin['name']:<16} {plugin['version']:<8} {plugin['state']}{why}; "
            f"{applied}/{len(here)} patches applied"
            + (
                f" ({len(plugin['patches']) - len(here)} for other Megatron lines)"
                if len(here) < len(plugin["patches"])
                else ""
            ),
            flush=True,
        )
        aside = (plugin.get("report") or {}).get("inactive_reason")
        if aside:
            print(f"  {'':<16} {aside}", flush=True)
