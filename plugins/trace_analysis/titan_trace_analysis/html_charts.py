"""Inline-SVG charts for the HTML report: heatmaps with labels and a colour scale, bar charts,
time axes and timelines.  No scripts, no network; every label is escaped."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

COLORS = {
    "compute": "#4c78a8",
    "bubble": "#222222",
    "pp_recv": "#f58518",
    "pp_send": "#ffbf79",
    "ep_a2a": "#e45756",
    "dp_reduce_scatter": "#72b7b2",
    "dp_all_gather": "#54a24b",
    "dp_all_reduce": "#b279a2",
    "other_comm": "#9d755d",
    "p2p": "#bcbd22",
    "host/launch": "#bab0ac",
}


def esc(x: Any) -> str:
    """HTML-escaped text."""
    return html.escape(str(x), quote=True)


def ramp(v: float) -> str:
    """White (0) to red (1)."""
    v = min(1.0, max(0.0, v))
    g = int(255 - 200 * v)
    return f"rgb(255,{g},{g})"


def ticks(span: float, n: int = 8) -> list[float]:
    """Round tick positions (microseconds from the start) covering [0, span]."""
    raw = max(span, 1e-9) / n
    mag = 10 ** (len(str(int(raw))) - 1) if raw >= 1 else 1.0
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    out = []
    t = 0.0
    while t < span - 0.4 * step:  # keep the end label clear of the last round tick
        out.append(t)
        t += step
    return out + [span]


def axis(x0: float, y: float, width: float, t0: float, t1: float) -> str:
    """A time axis in ms under a chart of ``width`` pixels starting at ``x0``."""
    sx = width / max(t1 - t0, 1e-9)
    parts = [f'<line x1="{x0}" x2="{x0 + width}" y1="{y}" y2="{y}" stroke="#555"/>']
    for t in ticks(t1 - t0):
        x = x0 + t * sx
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}" stroke="#555"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{y + 15}" font-size="10" text-anchor="middle">'
            f"{t / 1000:.1f}</text>"
        )
    parts.append(f'<text x="{x0 + width + 22}" y="{y + 15}" font-size="10">ms</text>')
    return "".join(parts)


def colour_scale(x: float, y: float, lo: str, hi: str, label: str) -> str:
    """A white-to-red legend bar with its end labels."""
    stops = "".join(f'<rect x="{x + 12 * i}" y="{y}" width="12" height="10" fill="{ramp(i / 9)}"/>'
                    for i in range(10))  # fmt: skip
    return (
        f'{stops}<rect x="{x}" y="{y}" width="120" height="10" fill="none" stroke="#999"/>'
        f'<text x="{x}" y="{y + 22}" font-size="10">{esc(lo)}</text>'
        f'<text x="{x + 120}" y="{y + 22}" font-size="10" text-anchor="end">{esc(hi)}</text>'
        f'<text x="{x + 130}" y="{y + 9}" font-size="10">{esc(label)}</text>'
    )


def heatmap(
    cells: dict[int, dict[int, float | str | None]],
    fmt: Callable[[float], str],
    scale: float,
    label: str,
    lo: str,
    hi: str,
) -> str:
    """Rows = stages, columns = position in the stage; ``None`` = missing rank, a str = not
    measured, and why (both hatched)."""
    if not cells:
        return "<p>no per-step data</p>"
    width = max(len(v) for v in cells.values())
    cell = max(6, min(40, 960 // max(1, width)))
    left, top = 64, 18
    h = top + cell * len(cells) + 40
    out = [
        f'<svg role="img" aria-label="{esc(label)}" width="{max(left + cell * width, 360) + 10}" '
        f'height="{h}"><defs><pattern id="hatch" width="4" height="4" '
        'patternUnits="userSpaceOnUse"><path d="M0,4 L4,0" stroke="#999"/></pattern></defs>'
    ]
    for y, (stage, row) in enumerate(sorted(cells.items())):
        yy = top + y * cell
        out.append(f'<text x="0" y="{yy + cell / 2 + 4}" font-size="11">stage {stage}</text>')
        for x, (rank, v) in enumerate(sorted(row.items())):
            xx = left + x * cell
            fill = "url(#hatch)" if v is None or isinstance(v, str) else ramp(v / scale)
            tip = (
                f"rank {rank}: missing"
                if v is None
                else f"rank {rank}: not measured ({v})"
                if isinstance(v, str)
                else f"rank {rank}: {label} {fmt(v)}"
            )
            out.append(
                f'<rect x="{xx}" y="{yy}" width="{cell - 1}" height="{cell - 1}" fill="{fill}" '
                f'stroke="#ddd"><title>{esc(tip)}</title></rect>'
            )
            if cell >= 22:
                out.append(
                    f'<text x="{xx + cell / 2}" y="{yy + cell / 2 + 3}" font-size="9" '
                    f'text-anchor="middle">{rank}</text>'
                )
            elif x % max(1, 24 // cell) == 0 and y == 0:
                out.append(f'<text x="{xx}" y="{top - 4}" font-size="9">{rank}</text>')
    out.append(colour_scale(left, top + cell * len(cells) + 8, lo, hi, label))
    out.append("</svg>")
    return "".join(out)


def bars(rows: list[tuple[str, float | None, str]], unit_max: float = 1.0) -> str:
    """Horizontal bars (label, value in [0, unit_max] or None, text shown at the bar's end)."""
    if not rows:
        return "<p>no data</p>"
    lh, left, width = 22, 80, 600
    out = [f'<svg width="{left + width + 120}" height="{lh * len(rows) + 26}">']
    for i, (label, value, text) in enumerate(rows):
        y = i * lh
        out.append(f'<text x="0" y="{y + 15}" font-size="11">{esc(label)}</text>')
        if value is not None:
            w = width * min(1.0, max(0.0, value / unit_max))
            out.append(f'<rect x="{left}" y="{y + 4}" width="{w:.1f}" height="14" fill="#d62728"/>')
        out.append(f'<text x="{left + 6 + (width if value is None else w):.1f}" y="{y + 15}" '
                   f'font-size="11">{esc(text)}</text>')  # fmt: skip
    y = lh * len(rows)
    for i in range(6):
        x = left + width * i / 5
        out.append(f'<line x1="{x}" x2="{x}" y1="{y}" y2="{y + 4}" stroke="#555"/>')
        out.append(f'<text x="{x}" y="{y + 16}" font-size="10" text-anchor="middle">'
                   f"{100 * unit_max * i / 5:.0f}%</text>")  # fmt: skip
    out.append("</svg>")
    return "".join(out)


def legend(kinds: list[str]) -> str:
    """Colour swatches for ``kinds``."""
    items = "".join(
        f'<span><i class="sw" style="background:{COLORS.get(k, "#888")}"></i>{esc(k)}</span>'
        for k in kinds
    )
    return f'<p class="legend">{items}</p>'


def coalesce(
    segs: list[tuple[str, float, float]], resolution: float
) -> list[tuple[str, float, float]]:
    """Segments of each kind merged where they are closer than ``resolution`` (one pixel):
    what a screen can show, in a bounded number of shapes whatever the trace's size."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for kind, a, b in segs:
        by_kind.setdefault(kind, []).append((a, b))
    out = []
    for kind, spans in by_kind.items():
        spans.sort()
        cur_a, cur_b = spans[0]
        for a, b in spans[1:]:
            if a - cur_b < resolution:
                cur_b = max(cur_b, b)
            else:
                out.append((kind, cur_a, cur_b))
                cur_a, cur_b = a, b
        out.append((kind, cur_a, cur_b))
    return out


def lanes(
    rows: list[tuple[str, list[tuple[str, float, float]]]],
    t0: float,
    t1: float,
    arrows: list[tuple[int, int, float]] | None = None,
    split: bool = False,
) -> str:
    """A timeline: one lane per row (label, [(kind, start, end)]), an axis, optional arrows
    (from row, to row, time) linking lanes; ``split``: compute and bubbles in the upper half of
    a lane, communication in the lower half."""
    if not rows:
        return "<p>no timeline</p>"
    w, lh, left = 1000.0, (18 if split else 14), 90
    sx = w / max(t1 - t0, 1e-9)
    out = [f'<svg width="{int(w) + left + 30}" height="{lh * len(rows) + 34}">']
    for i, (label, segs) in enumerate(rows):
        y = i * lh
        out.append(f'<text x="0" y="{y + 11}" font-size="10">{esc(label)}</text>')
        for kind, a, b in coalesce(segs, 1.0 / sx) if segs else ():
            if b <= t0 or a >= t1:
                continue
            x = left + (max(a, t0) - t0) * sx
            top, height = y + 2, lh - 4
            if split:
                height = (lh - 4) / 2
                top += 0 if kind in ("compute", "bubble") else height
            out.append(
                f'<rect x="{x:.1f}" y="{top}" width="{max(0.5, (min(b, t1) - max(a, t0)) * sx):.1f}" '
                f'height="{height}" fill="{COLORS.get(kind, "#888")}"><title>{esc(kind)} '
                f"{(b - a) / 1000:.3f} ms</title></rect>"
            )
    for r0, r1, t in arrows or ():
        x = left + (t - t0) * sx
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{r0 * lh + lh / 2}" y2="{r1 * lh + lh / 2}" '
            'stroke="#333" stroke-width="0.8"/>'
        )
    out.append(axis(left, lh * len(rows) + 4, w, t0, t1))
    out.append("</svg>")
    return "".join(out)
