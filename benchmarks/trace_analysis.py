"""Trace analysis (plugin ``trace_analysis``): our analyzer vs Meta's HTA 0.5.0 on the same
generated traces (default 32 ranks x ~200k events, PP x EP x DP MoE, our generator).

Each tool runs in its own process tree, sampled every 50 ms through /proc: CPU seconds are
user+sys summed over every process of the tree (pool workers included), peak memory is the
largest sum of RSS over the tree at one moment.  Ours: ``titan-trace analyze`` (every analysis,
JSON + HTML) on a local pool of ``--workers`` processes.  HTA: ``TraceAnalysis(trace_dir)`` +
temporal breakdown + comm/comp overlap + idle-time breakdown on all ranks (its nearest
equivalents; it has no bubble or cross-rank critical-path analysis), installed by this script
into its own venv (``holistictraceanalysis==0.5.0 "pandas<3"``; pandas 3 breaks its critical
path).  Goals: >= 10x less CPU per event, >= 10x less peak memory.

Then a projection for 10,000 ranks x 200k events on a 64-core machine with 64 GB, from the
measured per-event and per-rank costs (model in ``project()``).

Usage: python benchmarks/trace_analysis.py [--ranks 32] [--events 200000] [--rounds 3]
           [--workdir /tmp/titan-trace-bench] [--skip-hta] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HTA_SCRIPT = """
import sys, time
from hta.trace_analysis import TraceAnalysis
t0 = time.time()
a = TraceAnalysis(trace_dir=sys.argv[1])
t1 = time.time()
a.get_temporal_breakdown(visualize=False)
a.get_comm_comp_overlap(visualize=False)
a.get_idle_time_breakdown(ranks=sorted(a.t.traces), visualize=False)
print({"load_s": t1 - t0, "analyses_s": time.time() - t1})
"""
CLK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree(root: int) -> list[int]:
    """pids of ``root`` and all its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as fh:
                    todo += [int(x) for x in fh.read().split()]
        except OSError:
            continue
    return out


def _stat(pid: int) -> tuple[float, int] | None:
    """(user+sys CPU seconds, RSS bytes) of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK, int(fields[21]) * PAGE


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; return wall, tree CPU seconds, peak tree RSS and the main process's peak."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    cpu: dict[int, float] = {}
    peak = main_peak = 0
    while proc.poll() is None:
        total = 0
        for pid in _tree(proc.pid):
            st = _stat(pid)
            if st:
                cpu[pid] = st[0]
                total += st[1]
                if pid == proc.pid:
                    main_peak = max(main_peak, st[1])
        peak = max(peak, total)
        time.sleep(0.05)
    out = proc.stdout.read().decode(errors="replace")
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}):\n{out[-3000:]}")
    return {
        "wall_s": time.monotonic() - t0,
        "cpu_s": sum(cpu.values()),
        "main_cpu_s": cpu.get(proc.pid, 0.0),
        "peak_rss": peak,
        "main_peak_rss": main_peak,
        "output": out[-2000:],
    }


def generate(workdir: Path, ranks: int, events: int) -> dict:
    """Traces (reused when the same size exists) and the generator's info."""
    traces = workdir / f"r{ranks}_e{events}"
    info_path = Path(str(traces) + ".geninfo.json")
    if not info_path.exists():
        cmd = [sys.executable, "-m", "titan_trace_analysis.gen_traces", "--out", str(traces)]
        subprocess.run([*cmd, "--ranks", str(ranks), "--events", str(events)], check=True)
    info = json.loads(info_path.read_text())
    info["dir"] = str(traces)
    return info


def hta_python(workdir: Path) -> str:
    """Python of a venv with HTA 0.5.0 and pandas < 3 (created on first use)."""
    venv = workdir / "hta-venv"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "holistictraceanalysis==0.5.0", "pandas<3"], check=True)
    return str(py)


def project(ours: dict, half: dict, hta: dict | None, events: int, ranks: int) -> list[tuple]:
    """10,000 ranks x 200k events on 64 cores / 64 GB from measured costs.

    Ours: the map's CPU (workers) scales with ranks x events and spreads over 64 workers; the
    parent's serial CPU and memory grow with ranks at the slope measured between a run on half
    the ranks (``half``) and on all of them; memory = 64 workers at their measured peak (scaled
    with events per rank) + the parent.  HTA: the model of research/hta.md section 7 with the
    costs measured here: worker CPU / 64 + the parent's serial CPU scaled with ranks x events;
    memory = the parent (which holds every rank) scaled with ranks x events.
    """
    n, cores = 10_000, 64
    scale_e = 200_000 / events
    rows = []
    worker_cpu = (ours["cpu_s"] - ours["main_cpu_s"]) / ranks * scale_e
    slope_cpu = max(0.0, (ours["main_cpu_s"] - half["main_cpu_s"]) / (ranks - ranks // 2))
    slope_mem = max(0.0, (ours["main_peak_rss"] - half["main_peak_rss"]) / (ranks - ranks // 2))
    serial = ours["main_cpu_s"] + slope_cpu * (n - ranks)
    worker_mem = (ours["peak_rss"] - ours["main_peak_rss"]) / ours["workers"] * scale_e
    mem = cores * worker_mem + ours["main_peak_rss"] + slope_mem * (n - ranks)
    rows.append(
        ("titan-trace", (n * worker_cpu / cores + serial) / 60, mem / 2**30, worker_cpu, slope_cpu)
    )
    if hta:
        worker_cpu = (hta["cpu_s"] - hta["main_cpu_s"]) / ranks * scale_e
        main_cpu = hta["main_cpu_s"] / ranks * scale_e
        mem = hta["main_peak_rss"] * n / ranks * scale_e
        rows.append(
            (
                "HTA 0.5.0",
                (n * worker_cpu / cores + n * main_cpu) / 60,
                mem / 2**30,
                worker_cpu,
                main_cpu,
            )
        )
    return rows


def main() -> None:
    """Run both tools, print the ratios and the projection."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3, help="runs of ours (median); HTA runs once")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", default="/tmp/titan-trace-bench")
    ap.add_argument("--skip-hta", action="store_true")
    a = ap.parse_args()
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    info = generate(workdir, a.ranks, a.events)
    n_events = info["events_total"]
    print(f"traces: {a.ranks} ranks x ~{n_events // a.ranks:,} events = {n_events:,} events")
    py = None if a.skip_hta else hta_python(workdir)  # install first: a slow install skews nothing

    def ours_on(trace_dir: str) -> dict:
        cmd = [sys.executable, "-m", "titan_trace_analysis.cli", "analyze", trace_dir]
        cmd += ["--out", str(workdir / "ours"), "--workers", str(a.workers), "--no-progress"]
        return measure(cmd)

    runs = [ours_on(info["dir"]) for _ in range(a.rounds)]
    ours = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "output"}
    ours["workers"] = a.workers
    half_dir = workdir / f"half_{a.ranks}_{a.events}"  # first half of the ranks, for the slopes
    half_dir.mkdir(exist_ok=True)
    for r in range(a.ranks // 2):
        link = half_dir / f"rank-{r}.json.gz"
        if not link.exists():
            link.symlink_to(Path(info["dir"]) / f"rank-{r}.json.gz")
    half = ours_on(str(half_dir))
    print(
        f"ours: wall {ours['wall_s']:.1f} s, CPU {ours['cpu_s']:.1f} s (parent "
        f"{ours['main_cpu_s']:.1f}), peak {ours['peak_rss'] / 2**20:.0f} MB (parent "
        f"{ours['main_peak_rss'] / 2**20:.0f}); runs' CPU s: "
        + ", ".join(f"{r['cpu_s']:.1f}" for r in runs),
        flush=True,
    )
    hta = None
    if py:
        script = workdir / "hta_run.py"
        script.write_text(HTA_SCRIPT)
        hta = measure([py, str(script), info["dir"]])
        print(f"HTA: CPU {hta['cpu_s']:.1f} s (parent {hta['main_cpu_s']:.1f})", flush=True)
        hta["workers"] = min(os.cpu_count() or 1, a.ranks)
        print("HTA:", hta["output"].strip().splitlines()[-1])

    print(f"\n{'':14}{'wall s':>9}{'CPU s':>9}{'CPU us/event':>14}{'peak RSS MB':>13}")
    for name, m in (("titan-trace", ours), ("HTA 0.5.0", hta)):
        if m:
            print(
                f"{name:14}{m['wall_s']:9.1f}{m['cpu_s']:9.1f}{1e6 * m['cpu_s'] / n_events:14.2f}"
                f"{m['peak_rss'] / 2**20:13.0f}"
            )
    print(f"(ours: median of {a.rounds} runs; HTA: 1 run)")
    if hta:
        print(
            f"ratios HTA/ours: CPU per event {hta['cpu_s'] / ours['cpu_s']:.1f}x (goal >= 10x), "
            f"peak memory {hta['peak_rss'] / ours['peak_rss']:.1f}x (goal >= 10x)"
        )
    print("\nprojection: 10,000 ranks x 200k events, 64 cores")
    print(f"{'':14}{'wall min':>10}{'memory GB':>11}{'worker CPU s/rank':>19}{'serial s/rank':>15}")
    for name, wall, mem, wcpu, mcpu in project(ours, half, hta, n_events // a.ranks, a.ranks):
        print(f"{name:14}{wall:10.1f}{mem:11.1f}{wcpu:19.2f}{mcpu:15.4f}")
    print("goal: < 30 min within 64 GB")


if __name__ == "__main__":
    main()
