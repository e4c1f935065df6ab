"""What the reader must know before trusting the numbers: inferred or impossible matching,
partial ranks, estimates, verdicts withheld.  Shown at the top of every output."""

from __future__ import annotations

from typing import Any

from .kinds import P2P


def _ranks(ranks: list[int], limit: int = 12) -> str:
    return ", ".join(map(str, ranks[:limit])) + (" ..." if len(ranks) > limit else "")


def collect_warnings(summaries: list[dict[str, Any]], report: dict[str, Any]) -> list[str]:
    """The warnings of one analysis, most important first."""
    out: list[str] = []
    ok = [s for s in summaries if s["status"] != "error"]
    by_title = sorted(s["rank"] for s in ok if s.get("comm_sources", {}).get("title"))
    by_name = sorted(s["rank"] for s in ok if s.get("comm_sources", {}).get("name"))
    p2p_unknown = any(
        P2P in row.get("comm_us", {}) for s in ok for row in s.get("steps", {}).values()
    )
    if p2p_unknown:
        out.append(
            "P2P pairing impossible: SendRecv kernels without collective args or CPU titles "
            f"(ranks {_ranks(by_name)}) cannot be told apart (pipeline vs expert traffic); the "
            "bubble is not measured there and the critical path does not cross those transfers. "
            "Record with PyTorch >= 2.3 (collective args) or Titan's capture (titan.p2p titles)"
        )
    elif by_name:
        out.append(
            f"collective kinds inferred from kernel names on ranks {_ranks(by_name)} (no "
            "collective args or CPU titles); group membership inferred from pg_config"
        )
    if by_title:
        out.append(
            f"collective args absent on ranks {_ranks(by_title)}: kinds and peers inferred from "
            "the CPU-side titles around the launches (nccl:send a->b, gloo:*, titan.p2p:*); "
            "P2P paired by order on each pair of ranks, collectives by order in each group"
        )
    partial = sorted(s["rank"] for s in ok if s.get("truncated") and s.get("rank") is not None)
    if partial:
        out.append(
            f"partial ranks {_ranks(partial)}: salvaged from truncated or damaged files "
            "(analysed up to their last complete event)"
        )
    present = {int(r) for r in report.get("ranks", {})}
    for late in report.get("lateness", []):
        if late.get("late_us") is not None:
            what = "partial" if late["rank"] in present else "missing"
            out.append(
                f"rank {late['rank']} ({what}): {late['verdict']}: its peers waited ~{late['late_us'] / 1000:.2f} ms per step "
                f"for it (estimate from {late['evidence']} transfers)"
            )
    for u in report.get("slow_units", []):
        if u["verdict"] == "insufficient peers":
            out.append(
                f"{u['unit']} {u['id']} differs {u['slowdown']:.2f}x from its only peer: "
                "insufficient peers for a verdict (which of the two is slow cannot be told)"
            )
    unresolved = sorted(
        {r for st in report["critical_path"]["steps"].values() for r in st["unresolved_peers"]}
    )
    if unresolved:
        out.append(
            f"critical path incomplete: it needs ranks {_ranks(unresolved)}, whose traces are "
            "missing or partial for those steps, or whose compute was not measured"
        )
    notes = sorted({n for s in ok for n in s.get("notes", []) if n.startswith("CPU-only")})
    out += notes
    from_name = sorted(s["rank"] for s in ok if s.get("rank_source") == "file name")
    if from_name:
        out.append(f"ranks {_ranks(from_name)} taken from file names (not in the traces)")
    return out
