"""Ops of a CPU-only trace (a gloo run): communication titles and the training thread's compute.

On CPU there are no kernels: the training thread itself blocks inside a receive or waits for a
gloo collective.  Communication ops are the titles (``gloo:*``, ``titan.p2p:*``); compute is the
time inside leaf CPU ops (aten kernels) of the training thread, outside those titles.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import intervals as iv
from .drops import Drops, check, valid_id
from .kinds import COMM, COMPUTE, CPU_COMM_NAME, PP_RECV, PP_SEND, title_parts
from .ops import Labeller, Op, Title, sort_ops


def cpu_ops(
    events: Iterable[dict[str, Any]],
    titles: list[Title],
    lab: Labeller,
    threads: set[int],
    drops: Drops | None = None,
) -> tuple[list[Op], dict[str, list[float]]]:
    """Ops of a CPU-only trace: titles as communication, training-thread CPU ops as compute.

    ``threads``: the training thread(s) (those with ProfilerStep annotations).  Compute is the
    time inside leaf CPU ops (ops with no op inside them: aten kernels), so a thread blocked
    waiting for a collective inside an enclosing op (an autograd function) is idle, not busy;
    ops inside a communication title (buffer copies of a send) are communication.  When Titan's
    ``titan.p2p:*`` titles are present, the gloo / nccl send-recv titles nested in them are
    dropped (the same transfer seen twice).  A CPU op that may be the training thread's (its
    tid is not an integer) or is, with impossible times, is counted in ``drops``.
    """
    schedule = any(t.name.startswith("titan.p2p:") for t in titles)
    comm: list[Op] = []
    for t in titles:
        parts = title_parts(t.name) or ()
        if schedule and not t.name.startswith("titan.p2p:"):
            if any(k in (PP_SEND, PP_RECV) for k, _ in parts):
                continue
        comm += lab.from_title(t, Op(t.start, t.end, COMM, "", None, "", -1, posted=t.start))
    on_thread = iv.union((t.start, t.end) for t in titles if t.tid in threads)
    spans: dict[int, list[tuple[float, float, str]]] = {}
    drops = Drops() if drops is None else drops
    for ev in events:
        if ev.get("cat") != "cpu_op":
            continue
        tid = ev.get("tid")
        if valid_id(tid) and tid not in threads:
            continue  # another thread's op: not used, not dropped
        se = check(ev)
        if isinstance(se, str):
            drops.add(se, "CPU op")
            continue
        name = str(ev.get("name", ""))
        if CPU_COMM_NAME.match(name) or iv.covers(on_thread, se[0], se[1]):
            continue
        spans.setdefault(ev["tid"], []).append((se[0], se[1], name))
    busy, names = [], {}
    for leaf in (x for thread in spans.values() for x in _leaves(thread)):
        busy.append(leaf[:2])
        acc = names.setdefault(leaf[2], [0.0, 0.0])
        acc[0] += 1.0
        acc[1] += leaf[1] - leaf[0]
    compute = iv.subtract(iv.union(busy), on_thread)
    ops = [Op(a, b, COMPUTE, "", None, "", -1) for a, b in compute]
    return sort_ops(ops + comm), names


def _leaves(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The spans of one thread that contain no other span (nesting follows start times)."""
    spans.sort(key=lambda x: (x[0], -x[1]))
    out = []
    for i, (a, b, name) in enumerate(spans):
        nxt = spans[i + 1] if i + 1 < len(spans) else None
        if nxt is None or nxt[0] >= b:  # the next op starts after this one ends: no child
            out.append((a, b, name))
    return out
