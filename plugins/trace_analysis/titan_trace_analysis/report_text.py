"""Terminal summary of an analysis report (every name from a trace is escaped first)."""

from __future__ import annotations

from typing import Any

from .kinds import COMM_KINDS
from .safe import safe_text


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def header_lines(report: dict[str, Any]) -> list[str]:
    """The first lines: what was analysed, warnings, problems."""
    lines = [
        f"titan-trace: {report['ranks_analyzed']} ranks analysed from {report['files']} files, "
        f"{report['events']:,} events, steps {', '.join(report['steps']) or '-'}"
        + (" (window: HTA's, last step dropped)" if report.get("window") == "hta" else ""),
    ]
    for w in report.get("warnings", []):
        lines.append(f"WARNING: {safe_text(w, 600)}")
    if report["problems"]:
        lines.append(f"PARTIAL: {len(report['problems'])} problem(s):")
        lines += [
            f"  {safe_text(p['file'])}: {safe_text(p['problem'], 600)}" for p in report["problems"]
        ]
    return lines


def _rank_lines(report: dict[str, Any], max_ranks: int) -> list[str]:
    lines = ["per rank, mean per step (ms): compute | " + " | ".join(COMM_KINDS)]
    lines.append("   + overlap, exposed comm, compute-stream idle, bubble ratio")
    ranks = report["ranks"]
    for i, (r, row) in enumerate(ranks.items()):
        if i >= max_ranks:
            lines.append(f"  ... {len(ranks) - max_ranks} more ranks in the JSON/HTML report")
            break
        m = row.get("mean_per_step")
        tag = " (partial)" if row.get("partial") else ""
        lost = row.get("compute_not_measured")
        pp = row["coords"].get("pp", "-")
        if not m:
            span = (row.get("temporal") or {}).get("span_us")
            what = f"GPU span {_ms(span)} ms" if span is not None else "no GPU op measured"
            what += f"; compute not measured: {safe_text(lost)}" if lost else ""
            lines.append(f"  rank {r:>5}{tag}: no steps; {what}")
            continue
        if lost:  # never a row of zeros: communication alone was measured
            lines.append(
                f"  rank {r:>5} pp{pp}{tag}: compute not measured: {safe_text(lost)}; "
                f"communication busy {_ms(m.get('comm_busy_us'))} ms per step"
            )
            continue
        comm = " ".join(f"{_ms(m.get('comm.' + k, 0.0)):>7}" for k in COMM_KINDS)
        lines.append(
            f"  rank {r:>5} pp{pp}{tag}: {_ms(m.get('compute_us')):>8} | {comm} | "
            f"ovl {_ms(m.get('overlap_us'))} exp {_ms(m.get('exposed_comm_us'))} "
            f"idle {_ms(m.get('compute_idle_us'))} bubble {_pct(m.get('bubble_ratio'))}"
        )
    return lines


def _slow_lines(report: dict[str, Any]) -> list[str]:
    units = report.get("slow_units", [])
    slow = [u for u in units if u["verdict"] == "slow"]
    if not slow:
        return ["slow units: none above the threshold (compared work-normalised across ranks)"]
    lines = ["slow units (kernel time vs the same kernels elsewhere, work-normalised):"]
    for u in slow:
        same = "".join(f" = {s['unit']} {safe_text(s['id'])}" for s in u.get("same_as", []))
        where = ""
        if u["unit"] == "rank":
            where = f" (stage {u.get('stage')}, expert group {u.get('expert_group')})"
            where += " [partial trace]" if u.get("partial") else ""
        ranks = u["ranks"]
        shown = ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")
        lines.append(
            f"  {u['unit']} {safe_text(u['id'])}{same}{where}: {u['slowdown']:.2f}x its "
            f"{u['peers']} peers; ranks {shown}"
        )
    return lines


def render(report: dict[str, Any], max_ranks: int = 32) -> str:
    """A plain-text summary: warnings, problems, per-rank table, stages, slow units, path."""
    lines = header_lines(report)
    lines.append("")
    lines += _rank_lines(report, max_ranks)
    if report["stages"]:
        lines.append("")
        lines.append("pipeline bubble by stage (compute stream waiting on a pipeline receive):")
        for s in report["stages"]:
            why = safe_text(s.get("not_measured", ""), 600)
            if s["bubble_ratio"] is None:
                lines.append(
                    f"  stage {s['stage']}: not measured ({why}); step window "
                    f"{_ms(s['window_us'])} ms, {s['ranks']} ranks"
                )
                continue
            lines.append(
                f"  stage {s['stage']}: {_pct(s['bubble_ratio']):>6} of the step "
                f"({_ms(s['bubble_us'])} of {_ms(s['window_us'])} ms, {s['ranks']} ranks); "
                f"compute idle {_pct(s['compute_idle_ratio'])}" + (f" ({why})" if why else "")
            )
    lines.append("")
    lines += _slow_lines(report)
    for late in report.get("lateness", []):
        if late.get("late_us") is not None:
            lines.append(
                f"  rank {late['rank']} (no trace for steps {', '.join(late['steps'])}): "
                f"{late['verdict']}; peers waited ~{_ms(late['late_us'])} ms per step"
            )
    cp = report["critical_path"]
    if cp["steps"]:
        lines.append("")
        lines.append("cross-rank critical path per step (what bounds it):")
        for k, st in cp["steps"].items():
            kinds = ", ".join(
                f"{kind} {100 * v['share']:.0f}%" for kind, v in list(st["by_kind"].items())[:5]
            )
            top = ", ".join(f"r{x['rank']} {100 * x['share']:.0f}%" for x in st["top_ranks"][:4])
            lines.append(f"  step {k}: {_ms(st['length_us'])} ms = {kinds}; ranks {top}")
            if st["unresolved_peers"]:
                missing = ", ".join(str(r) for r in st["unresolved_peers"][:10])
                lines.append(
                    f"    (incomplete: the path needs ranks {missing}, missing or not measured)"
                )
    return "\n".join(lines)
