"""Terminal summary of an analysis report."""

from __future__ import annotations

from typing import Any

from .kinds import COMM_KINDS


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.2f}"


def render(report: dict[str, Any], max_ranks: int = 32) -> str:
    """A plain-text summary: problems, per-rank table, stages, slow ranks, critical path."""
    lines = [
        f"titan-trace: {report['ranks_analyzed']} ranks analysed from {report['files']} files, "
        f"{report['events']:,} events, steps {', '.join(report['steps']) or '-'}",
    ]
    if report["problems"]:
        lines.append(f"PARTIAL: {len(report['problems'])} problem(s):")
        lines += [f"  {p['file']}: {p['problem']}" for p in report["problems"]]
    lines.append("")
    lines.append("per rank, mean per step (ms): compute | " + " | ".join(COMM_KINDS))
    lines.append("   + overlap, exposed comm, compute-stream idle, bubble ratio")
    ranks = report["ranks"]
    for i, (r, row) in enumerate(ranks.items()):
        if i >= max_ranks:
            lines.append(f"  ... {len(ranks) - max_ranks} more ranks in the JSON/HTML report")
            break
        m = row.get("mean_per_step")
        if not m:
            t = row.get("temporal") or {}
            lines.append(f"  rank {r:>5}: no steps; GPU span {_ms(t.get('span_us'))} ms")
            continue
        comm = " ".join(f"{_ms(m.get('comm.' + k, 0.0)):>7}" for k in COMM_KINDS)
        pp = row["coords"].get("pp", "-")
        lines.append(
            f"  rank {r:>5} pp{pp}: {_ms(m['compute_us']):>8} | {comm} | "
            f"ovl {_ms(m['overlap_us'])} exp {_ms(m['exposed_comm_us'])} "
            f"idle {_ms(m['compute_idle_us'])} bubble {100 * m['bubble_ratio']:.1f}%"
        )
    if report["stages"]:
        lines.append("")
        lines.append("pipeline bubble by stage (time the compute stream waits on a receive):")
        for s in report["stages"]:
            lines.append(
                f"  stage {s['stage']}: {100 * s['bubble_ratio']:5.1f}% of the step "
                f"({_ms(s['bubble_us'])} of {_ms(s['window_us'])} ms, {s['ranks']} ranks); "
                f"compute idle {100 * s['compute_idle_ratio']:.1f}%"
            )
    lines.append("")
    if report["slow_ranks"]:
        lines.append("slow ranks (compute time vs the other ranks of the same stage):")
        for s in report["slow_ranks"]:
            lines.append(
                f"  rank {s['rank']} (stage {s['stage']}, expert group {s['expert_group']}): "
                f"{s['slowdown']:.2f}x ({_ms(s['compute_us'])} vs {_ms(s['peer_median_us'])} ms)"
            )
    else:
        lines.append("slow ranks: none above the threshold")
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
                lines.append(f"    (incomplete: the path needs missing ranks {missing})")
    return "\n".join(lines)
