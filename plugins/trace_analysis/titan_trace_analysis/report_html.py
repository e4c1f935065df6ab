"""Self-contained HTML report (inline SVG, no scripts or network): warnings first, then labelled
heatmaps with colour scales, the bubble per stage, an all-rank timeline of one step, the
critical path and the text summary."""

from __future__ import annotations

from statistics import median
from typing import Any

from . import timeline_file
from .html_charts import COLORS, bars, esc, heatmap, lanes, legend

CSS = (
    "body{font:14px sans-serif;margin:24px;color:#222}h2{margin-top:28px}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
    ".warn{background:#fff4e5;border-left:4px solid #e67e22;padding:6px 10px;margin:4px 0}"
    ".bad{color:#b00}.legend span{display:inline-block;margin-right:12px}"
    ".sw{display:inline-block;width:10px;height:10px;margin-right:4px}"
)
TIMELINE_RANKS = 64


def _grid(report: dict[str, Any], value) -> dict[int, dict[int, float | str | None]]:
    """stage -> rank -> value (None for a rank of the stage without data: it keeps its place;
    the reason, a str, for a rank whose compute was not measured)."""
    cells: dict[int, dict[int, float | str | None]] = {}
    for r, stage in report.get("stage_of", {}).items():
        cells.setdefault(int(stage), {})[int(r)] = None
    for r, row in report["ranks"].items():
        m = row.get("mean_per_step")
        stage = int(row["coords"].get("pp", 0))
        lost = row.get("compute_not_measured")
        cells.setdefault(stage, {})[int(r)] = lost if lost else value(r, m) if m else None
    return cells


def _slow_heatmap(report: dict[str, Any]) -> str:
    by_stage: dict[int, list[float]] = {}
    for row in report["ranks"].values():
        m = row.get("mean_per_step")
        if m and "compute_us" in m:
            by_stage.setdefault(int(row["coords"].get("pp", 0)), []).append(m["compute_us"])
    base = {k: median(v) for k, v in by_stage.items()}

    def rel(r: str, m: dict) -> float | None:
        b = base.get(int(report["ranks"][r]["coords"].get("pp", 0)))
        return m["compute_us"] / b if b and "compute_us" in m else None

    cells = _grid(report, rel)
    cells = {s: {r: (max(0.0, v - 1.0) if isinstance(v, float) else v) for r, v in row.items()}
             for s, row in cells.items()}  # fmt: skip
    return heatmap(cells, lambda v: f"{1 + v:.2f}x the stage median", 0.5, "compute time",
                   "1.0x", ">= 1.5x")  # fmt: skip


def _bubble_heatmap(report: dict[str, Any]) -> str:
    cells = _grid(report, lambda r, m: m.get("bubble_ratio"))
    return heatmap(cells, lambda v: f"{100 * v:.1f}%", 1.0, "bubble share of the step", "0%",
                   "100%")  # fmt: skip


def _step_timeline(report: dict[str, Any]) -> str:
    """Every rank (up to TIMELINE_RANKS) in the detail step: compute, comm kinds, bubbles."""
    cp = report["critical_path"]
    step, timelines = cp.get("detail_step"), report.get("_timelines", {})
    if step is None or not timelines:
        return "<p>no timeline (no step with GPU or CPU ops)</p>"
    st = cp["steps"][step]
    stage = {int(r): v for r, v in report.get("stage_of", {}).items()}
    rows = []
    for r in sorted(timelines, key=lambda r: (stage.get(int(r), 0), int(r)))[:TIMELINE_RANKS]:
        tl = timeline_file.read_step(timelines[r], step)
        if not tl:
            continue
        segs = [("compute", tl["comp"][i], tl["comp"][i + 1]) for i in range(0, len(tl["comp"]), 2)]
        segs += [(op[0], op[1], op[2]) for op in tl["ops"]]
        bub = tl.get("bub", [])
        segs += [("bubble", bub[i], bub[i + 1]) for i in range(0, len(bub), 2)]
        rows.append((f"r{r} pp{stage.get(int(r), 0)}", segs))
    more = len(timelines) - len(rows)
    note = f"<p>{more} more ranks in merged_trace.json</p>" if more > 0 else ""
    return lanes(rows, st["start_us"], st["end_us"], split=True) + note


def _path(report: dict[str, Any]) -> str:
    segs = report["critical_path"]["segments"][:4000]
    if not segs:
        return "<p>no critical path (no steps with ops)</p>"
    stage = {int(r): v for r, v in report.get("stage_of", {}).items()}
    order = sorted({s[0] for s in segs}, key=lambda r: (stage.get(r, 0), r))
    idx = {r: i for i, r in enumerate(order)}
    rows = [(f"r{r} pp{stage.get(r, 0)}", [(k, a, b) for rr, k, a, b in segs if rr == r])
            for r in order]  # fmt: skip
    arrows = [(idx[a[0]], idx[b[0]], b[2]) for a, b in zip(segs, segs[1:]) if a[0] != b[0]]
    return lanes(rows, min(s[2] for s in segs), max(s[3] for s in segs), arrows)


def render(report: dict[str, Any], text_summary: str) -> str:
    """The whole report as one HTML document."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>titan-trace report</title>"
        f"<style>{CSS}</style></head><body><h1>titan-trace: {report['ranks_analyzed']} ranks</h1>",
        f"<p>{esc(report['trace_dir'])} &middot; {report['events']:,} events &middot; steps "
        f"{esc(', '.join(report['steps']))}</p>",
    ]
    for w in report.get("warnings", []):
        parts.append(f"<div class='warn'><b>Warning:</b> {esc(w)}</div>")
    if report["problems"]:
        parts.append("<h2 class='bad'>Problems (partial analysis)</h2><ul>")
        parts += [f"<li>{esc(p['file'])}: {esc(p['problem'])}</li>" for p in report["problems"]]
        parts.append("</ul>")
    parts.append("<h2>Pipeline bubble by stage</h2>")
    parts.append(bars([(f"stage {s['stage']}", s["bubble_ratio"],
                        f"not measured ({s.get('not_measured', 'unknown')})"
                        if s["bubble_ratio"] is None
                        else f"{100 * s['bubble_ratio']:.1f}% ({s['bubble_us'] / 1000:.2f} ms)")
                       for s in report["stages"]]))  # fmt: skip
    parts.append("<h2>Bubble share of the step, per rank</h2>" + _bubble_heatmap(report))
    parts.append("<h2>Compute time vs its stage's median, per rank</h2>" + _slow_heatmap(report))
    parts.append("<h2>Slow units (work-normalised)</h2><ul>")
    slow = [u for u in report.get("slow_units", []) if u["verdict"] == "slow"]
    parts += [f"<li>{esc(u['unit'])} {esc(u['id'])}: {u['slowdown']:.2f}x its {u['peers']} "
              f"peers (ranks {esc(', '.join(map(str, u['ranks'][:32])))})</li>"
              for u in slow] or ["<li>none above the threshold</li>"]  # fmt: skip
    parts.append("</ul>")
    cp = report["critical_path"]
    kinds = list(COLORS)
    parts.append(f"<h2>All ranks, step {esc(cp['detail_step'])}</h2>{legend(kinds)}")
    parts.append("<p>Upper half of each lane: compute and pipeline bubbles; lower half: "
                 "communication.</p>")  # fmt: skip
    parts.append(_step_timeline(report))
    parts.append(f"<h2>Critical path, step {esc(cp['detail_step'])}</h2>{legend(kinds)}")
    parts.append(_path(report))
    parts.append("<table><tr><th>step</th><th>length ms</th><th>bound by</th></tr>")
    for k, st in cp["steps"].items():
        by = ", ".join(f"{esc(n)} {100 * v['share']:.0f}%" for n, v in st["by_kind"].items())
        parts.append(
            f"<tr><td>{esc(k)}</td><td>{st['length_us'] / 1000:.2f}</td><td>{by}</td></tr>"
        )
    parts.append("</table>")
    parts.append(f"<h2>Summary</h2><pre>{esc(text_summary)}</pre></body></html>")
    return "".join(parts)
