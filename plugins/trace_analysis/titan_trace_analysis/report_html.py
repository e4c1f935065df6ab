"""Self-contained HTML report (inline SVG, no scripts or network): heatmaps, bubbles, path."""

from __future__ import annotations

import html
from typing import Any

COLORS = {
    "compute": "#4c78a8",
    "pp_recv": "#f58518",
    "pp_send": "#ffbf79",
    "ep_a2a": "#e45756",
    "dp_reduce_scatter": "#72b7b2",
    "dp_all_gather": "#54a24b",
    "dp_all_reduce": "#b279a2",
    "other_comm": "#9d755d",
    "host/launch": "#bab0ac",
}
CSS = (
    "body{font:14px sans-serif;margin:24px;color:#222}h2{margin-top:28px}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
    ".bad{color:#b00}.legend span{display:inline-block;margin-right:12px}"
    ".sw{display:inline-block;width:10px;height:10px;margin-right:4px}"
)


def _e(x: Any) -> str:
    return html.escape(str(x))


def _ramp(v: float) -> str:
    """White (0) to red (1)."""
    v = min(1.0, max(0.0, v))
    g = int(255 - 200 * v)
    return f"rgb(255,{g},{g})"


def heatmap(report: dict[str, Any], value, label: str, scale: float) -> str:
    """Ranks as cells, one row per pipeline stage; colour = value(rank_row) / scale."""
    rows: dict[int, list[tuple[int, float]]] = {}
    for r, row in report["ranks"].items():
        m = row.get("mean_per_step")
        if m:
            rows.setdefault(int(row["coords"].get("pp", 0)), []).append((int(r), value(r, m)))
    if not rows:
        return "<p>no per-step data</p>"
    width = max(len(v) for v in rows.values())
    cell = max(4, min(24, 960 // max(1, width)))
    out = [f'<svg width="{60 + cell * width}" height="{20 + cell * len(rows)}">']
    for y, (stage, cells) in enumerate(sorted(rows.items())):
        out.append(
            f'<text x="0" y="{14 + y * cell + cell / 2}" font-size="11">stage {stage}</text>'
        )
        for x, (rank, v) in enumerate(sorted(cells)):
            out.append(
                f'<rect x="{60 + x * cell}" y="{4 + y * cell}" width="{cell - 1}" '
                f'height="{cell - 1}" fill="{_ramp(v / scale)}"><title>rank {rank}: '
                f"{_e(label)} {v:.3f}</title></rect>"
            )
    out.append("</svg>")
    return "".join(out)


def path_timeline(report: dict[str, Any], max_segments: int = 4000) -> str:
    """The critical path of the longest step: one lane per rank on it, segments by kind."""
    segs = report["critical_path"]["segments"][:max_segments]
    if not segs:
        return "<p>no critical path (no steps with GPU events)</p>"
    stage = {int(r): int(v["coords"].get("pp", 0)) for r, v in report["ranks"].items()}
    lanes = sorted({s[0] for s in segs}, key=lambda r: (stage.get(r, 0), r))
    lane_y = {r: i for i, r in enumerate(lanes)}
    t0 = min(s[2] for s in segs)
    t1 = max(s[3] for s in segs)
    w, lh = 1000.0, 14
    sx = w / max(1e-9, t1 - t0)
    out = [f'<svg width="{int(w) + 90}" height="{lh * len(lanes) + 30}">']
    for r, i in lane_y.items():
        out.append(f'<text x="0" y="{i * lh + 11}" font-size="10">r{r} pp{stage.get(r, 0)}</text>')
    prev = None
    for rank, kind, a, b in segs:
        x = 80 + (a - t0) * sx
        y = lane_y[rank] * lh
        out.append(
            f'<rect x="{x:.1f}" y="{y + 2}" width="{max(0.5, (b - a) * sx):.1f}" height="{lh - 4}"'
            f' fill="{COLORS.get(kind, "#888")}"><title>rank {rank} {_e(kind)} '
            f"{(b - a) / 1000:.3f} ms</title></rect>"
        )
        if prev is not None and prev[0] != rank:
            out.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{lane_y[prev[0]] * lh + lh / 2}" '
                f'y2="{y + lh / 2}" stroke="#333" stroke-width="0.6"/>'
            )
        prev = (rank, a)
    out.append(
        f'<text x="80" y="{lh * len(lanes) + 24}" font-size="11">0 ms</text>'
        f'<text x="{int(w)}" y="{lh * len(lanes) + 24}" font-size="11">'
        f"{(t1 - t0) / 1000:.1f} ms</text></svg>"
    )
    return "".join(out)


def _legend() -> str:
    items = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{_e(k)}</span>' for k, c in COLORS.items()
    )
    return f'<p class="legend">{items}</p>'


def render(report: dict[str, Any], text_summary: str) -> str:
    """The whole report as one HTML document."""
    slow = {s["rank"]: s["slowdown"] for s in report["slow_ranks"]}
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>titan-trace report</title>"
        f"<style>{CSS}</style></head><body><h1>titan-trace: {report['ranks_analyzed']} ranks</h1>",
        f"<p>{_e(report['trace_dir'])} &middot; {report['events']:,} events &middot; steps "
        f"{_e(', '.join(report['steps']))}</p>",
    ]
    if report["problems"]:
        parts.append("<h2 class='bad'>Problems (partial analysis)</h2><ul>")
        parts += [f"<li>{_e(p['file'])}: {_e(p['problem'])}</li>" for p in report["problems"]]
        parts.append("</ul>")
    parts.append("<h2>Compute time vs stage median (slow ranks are red)</h2>")
    med = {}
    for row in report["ranks"].values():
        m = row.get("mean_per_step")
        if m:
            med.setdefault(row["coords"].get("pp", 0), []).append(m["compute_us"])
    stage_med = {k: sorted(v)[len(v) // 2] for k, v in med.items()}

    def rel(r: str, m: dict) -> float:
        base = stage_med.get(report["ranks"][r]["coords"].get("pp", 0)) or 1.0
        return max(0.0, m["compute_us"] / base - 1.0)

    parts.append(heatmap(report, rel, "slowdown-1", 0.5))
    parts.append("<h2>Pipeline bubble ratio per rank</h2>")
    parts.append(heatmap(report, lambda r, m: m["bubble_ratio"], "bubble ratio", 1.0))
    parts.append("<h2>Bubble by stage</h2><table><tr><th>stage</th><th>ranks</th>")
    parts.append("<th>bubble %</th><th>compute idle %</th><th>step window ms</th></tr>")
    for s in report["stages"]:
        parts.append(
            f"<tr><td>{s['stage']}</td><td>{s['ranks']}</td><td>{100 * s['bubble_ratio']:.1f}</td>"
            f"<td>{100 * s['compute_idle_ratio']:.1f}</td><td>{s['window_us'] / 1000:.2f}</td></tr>"
        )
    parts.append("</table>")
    parts.append("<h2>Slow ranks</h2><ul>")
    parts += [f"<li>rank {r}: {v:.2f}x its stage peers</li>" for r, v in slow.items()] or [
        "<li>none</li>"
    ]
    parts.append("</ul>")
    cp = report["critical_path"]
    parts.append(f"<h2>Critical path, step {_e(cp['detail_step'])}</h2>{_legend()}")
    parts.append(path_timeline(report))
    parts.append("<table><tr><th>step</th><th>length ms</th><th>bound by</th></tr>")
    for k, st in cp["steps"].items():
        kinds = ", ".join(f"{_e(n)} {100 * v['share']:.0f}%" for n, v in st["by_kind"].items())
        parts.append(f"<tr><td>{k}</td><td>{st['length_us'] / 1000:.2f}</td><td>{kinds}</td></tr>")
    parts.append("</table>")
    parts.append(f"<h2>Summary</h2><pre>{_e(text_summary)}</pre></body></html>")
    return "".join(parts)
