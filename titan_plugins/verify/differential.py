"""The differential training check of ``titan-plugins verify``: do the plugins still do their job
on this Megatron, and nothing else?

Megatron's own unit tests check shapes, counts and self-consistency; a plugin that scales every
linear output by 1.01 passes them. So a tiny MoE GPT is built and trained by the Megatron this
process imports (its own ``GPTModel``, schedules, ``finalize_model_grads`` and optimizer, on gloo
with the core's CPU harness) in two layouts, PP=2 x EP=2 and PP=2 x VPP=2 (4 ranks), and as the
mission's model, Kimi-K2's architecture at tiny size (MLA, shared expert), at PP=2 x EP=2: once with
every plugin off, once with each plugin alone, and once with all of them on. Every run is a fresh
4-process job (no plugin state survives from one run into the next) and starts from the same
weights and data (the runs: :mod:`titan_plugins.testing.training_runs`). Then, per plugin and
layout:

- the losses and grad norms of each step equal the off run's, bit for bit unless the plugin's
  data file (``upstream_tests.json``, ``differential``) states a relative bound (FP8's
  quantization);
- the plugin counted work in the run (``titan_effects``, read as the change over the run): a
  plugin that applied and did nothing is named as such, unless its data file says why it acts
  outside a training step (weight_sync);
- none of its patches failed.

The all-on run is held to the sum of the enabled plugins' bounds, and every plugin must count
work in it too. The verdict is data (:class:`PluginVerdict`); :mod:`titan_plugins.verify.cli`
prints it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from titan_plugins import manager
from titan_plugins.hosts import HOSTS
from titan_plugins.patching import gates, origin
from titan_plugins.verify import interrupt, selection

LAYOUTS: dict[str, dict[str, Any]] = {
    "pp2xep2": {"pp": 2, "ep": 2},
    "pp2xvpp2": {"pp": 2, "vpp": 2},
    "kimi_pp2xep2": {"pp": 2, "ep": 2, "model": "kimi"},
}
"""The layouts the check trains in (4 ranks each: the rest is data parallelism), each with a
model shape (``model``, default the MoE GPT; tiny_gpt.MODELS): ``kimi_pp2xep2`` is Kimi-K2's
architecture at tiny size (multi-latent attention, a dense first layer, a shared expert, a
sigmoid router with expert bias), the mission's model."""
WORLD_SIZE = 4
OFF, ALL = "off", "all"


@dataclass
class PluginVerdict:
    """What the check found for one plugin (``problems`` empty: it passed)."""

    plugin: str
    loss_bound: float
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """layout -> {"max_loss_gap", "max_norm_gap", "effects": {counter: change}, "failed": [...]}"""
    problems: list[str] = field(default_factory=list)
    not_judged: list[dict[str, str]] = field(default_factory=list)
    """``{"test", "why"}`` for each layout the plugin cannot run in (never counted as passed)."""

    @property
    def passed(self) -> bool:
        """No problem found."""
        return not self.problems

    @property
    def label(self) -> str:
        """FAIL (a problem), NOT JUDGED (no run judged it), PASS."""
        if self.problems:
            return "FAIL"
        return "PASS" if self.runs else "NOT JUDGED"


@dataclass
class DifferentialResult:
    """The whole check."""

    plugins: dict[str, PluginVerdict]
    all_on: dict[str, dict[str, Any]]
    problems: list[str]
    seconds: float
    not_run: list[str] = field(default_factory=list)
    """``"<layout> <run>"`` left out by the time budget."""
    megatron: str = ""
    """The Megatron the workers trained with."""

    @property
    def passed(self) -> bool:
        """No plugin and no all-on run failed (see :attr:`verdict` for what was judged)."""
        return not self.problems and all(v.passed for v in self.plugins.values())

    @property
    def verdict(self) -> str:
        """FAIL (a problem), INCOMPLETE (no problem, but runs left out or a plugin judged in
        no layout), PASS."""
        if not self.passed:
            return "FAIL"
        if self.not_run or any(v.label == "NOT JUDGED" for v in self.plugins.values()):
            return "INCOMPLETE"
        return "PASS"

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable."""
        return {
            "plugins": {name: asdict(v) for name, v in self.plugins.items()},
            "all_on": self.all_on,
            "problems": self.problems,
            "not_run": self.not_run,
            "megatron": self.megatron,
            "passed": self.passed,
            "verdict": self.verdict,
            "seconds": round(self.seconds, 1),
        }


def installed_plugins() -> dict[str, str]:
    """Plugin name -> its top-level package, for the plugins the registry discovers."""
    return {ep.name: ep.value.split(":", 1)[0].split(".", 1)[0] for ep in manager.discover()}


def runs_in(
    layout: str, names: list[str], plugin_specs: dict[str, selection.Differential]
) -> list[str]:
    """The plugins of ``names`` that can run in ``layout`` (the others declare why not)."""
    return [n for n in names if layout not in plugin_specs[n].not_in_layouts]


def _out_of_time(layout: str) -> dict[str, str]:
    """The ``not_judged`` entry of a run the time budget left out."""
    return {"test": f"differential:{layout}", "why": "not run: the time budget ran out"}


def chosen(names: list[str] | None) -> dict[str, str]:
    """``names`` (default: every installed plugin, sorted) -> their packages.

    :raises ValueError: a name that is not installed (the message lists what is).
    """
    plugins = installed_plugins()
    names = sorted(plugins) if names is None else list(names)
    unknown = [n for n in names if n not in plugins]
    if unknown:
        raise ValueError(
            f"not installed: {', '.join(unknown)}; installed: {', '.join(sorted(plugins))}"
        )
    return {n: plugins[n] for n in names}


def specs(plugins: dict[str, str]) -> dict[str, selection.Differential]:
    """Each plugin's ``differential`` declaration: from its data file, the defaults (held to
    bit-identity) where it ships none.

    :raises ValueError: a data file with a bad field (the message names the file and field).
    """
    out = {}
    for name, package in plugins.items():
        try:
            shipped = resources.files(package).joinpath(selection.DATA_FILE).is_file()
        except (ImportError, TypeError, ValueError):  # not a package: no data file
            shipped = False
        if not shipped:
            out[name] = selection.Differential()
            continue
        try:
            out[name] = selection.load(package).differential
        except selection.SelectionError as err:
            raise ValueError(str(err)) from None
    return out


def plan_runs(
    names: list[str], layouts: list[str], plugin_specs: dict[str, selection.Differential]
) -> list[tuple[str, str, list[str]]]:
    """``(layout, run name, plugins on)``: off, each plugin alone, all on; per layout, leaving
    out the plugins that declare they cannot run in it."""
    runs = []
    for layout in layouts:
        here = runs_in(layout, names, plugin_specs)
        runs.append((layout, OFF, []))
        runs += [(layout, f"+{name}", [name]) for name in here]
        if len(here) > 1:
            runs.append((layout, ALL, list(here)))
    return runs


# ---------------------------------------------------------------------------- judging
def _gap(run: list[float], off: list[float]) -> float:
    """The largest relative per-step gap (``inf`` when the runs have different lengths)."""
    if len(run) != len(off):
        return float("inf")
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run, off)), default=0.0)


def _within(gap: float, bound: float) -> bool:
    return gap == 0.0 if bound == 0.0 else gap <= bound


def _judge_run(
    ranks: list[dict[str, Any]], run: str, plugins: list[str], bound: float, norm_bound: float
) -> tuple[dict[str, Any], list[str]]:
    """One run of one layout against the off run: gaps, effects per plugin, failures."""
    loss_gap = max(_gap(r[run]["losses"], r[OFF]["losses"]) for r in ranks)
    norm_gap = max(_gap(r[run]["norms"], r[OFF]["norms"]) for r in ranks)
    effects: dict[str, dict[str, float]] = {}
    for rank in ranks:
        for plugin, counters in rank[run]["effects"].items():
            for key, change in counters.items():
                effects.setdefault(plugin, {}).setdefault(key, 0.0)
                effects[plugin][key] += change
    failed = sorted({pid for r in ranks for pid in r[run]["failed"]})
    summary = {
        "max_loss_gap": loss_gap,
        "max_norm_gap": norm_gap,
        "effects": {p: effects.get(p, {}) for p in plugins},
        "failed": failed,
    }
    problems = []
    if not _within(loss_gap, bound):
        problems.append(
            f"losses differ from the off run by {loss_gap:.3g} (relative, worst step)"
            + (f"; the stated bound is {bound:g}" if bound else "; they must be bit-identical")
        )
    if not _within(norm_gap, norm_bound):
        problems.append(
            f"grad norms differ from the off run by {norm_gap:.3g}"
            + (f"; the stated bound is {norm_bound:g}" if norm_bound else "; must be identical")
        )
    if failed:
        problems.append(f"patches failed: {', '.join(failed)}")
    return summary, problems


def judge(
    per_layout: dict[str, list[dict[str, Any]]],
    names: list[str],
    plugin_specs: dict[str, selection.Differential],
    not_run: Sequence[tuple[str, str]] = (),
) -> tuple[dict[str, PluginVerdict], dict[str, dict[str, Any]], list[str]]:
    """Verdicts per plugin, the all-on run's summary and its problems."""
    verdicts = {name: PluginVerdict(name, plugin_specs[name].loss_bound) for name in names}
    all_on: dict[str, dict[str, Any]] = {}
    all_problems: list[str] = []
    skipped = set(not_run)
    for layout, name in not_run:
        if name == OFF:  # nothing of the layout can be judged
            for plugin in names:
                verdicts[plugin].not_judged.append(_out_of_time(layout))
    for layout, ranks in per_layout.items():
        if OFF not in ranks[0]:
            all_problems.append(f"{layout}: the run with every plugin off failed: nothing judged")
            continue
        for name in names:
            spec = plugin_specs[name]
            if layout in spec.not_in_layouts:
                verdicts[name].not_judged.append(
                    {"test": f"differential:{layout}", "why": spec.not_in_layouts[layout]}
                )
                continue
            if (layout, f"+{name}") in skipped:
                verdicts[name].not_judged.append(_out_of_time(layout))
                continue
            if f"+{name}" not in ranks[0]:
                verdicts[name].problems.append(f"{layout}: training with it alone failed")
                continue
            summary, problems = _judge_run(
                ranks, f"+{name}", [name], spec.loss_bound, spec.norm_bound
            )
            verdicts[name].runs[layout] = summary
            verdicts[name].problems += [f"{layout}: {p}" for p in problems]
            if not spec.outside_the_step and not any(summary["effects"][name].values()):
                verdicts[name].problems.append(
                    f"{layout}: applied and did nothing: no work counted in the run "
                    "(titan_effects unchanged)"
                )
        if ALL in ranks[0]:
            here = runs_in(layout, names, plugin_specs)
            loss_bound = sum(plugin_specs[n].loss_bound for n in here)
            norm_bound = sum(plugin_specs[n].norm_bound for n in here)
            summary, problems = _judge_run(ranks, ALL, here, loss_bound, norm_bound)
            all_on[layout] = summary
            all_problems += [f"{layout}, all plugins on: {p}" for p in problems]
            idle = [
                n
                for n in here
                if not plugin_specs[n].outside_the_step and not any(summary["effects"][n].values())
            ]
            if idle:
                all_problems.append(
                    f"{layout}, all plugins on: no work counted by {', '.join(idle)}"
                )
    return verdicts, all_on, all_problems


def run(
    names: list[str] | None = None,
    layouts: list[str] | None = None,
    timeout_s: float = 1800.0,
    budget_s: float | None = None,
    megatron_lm: str | None = None,
) -> DifferentialResult:
    """Run the check for ``names`` (default: every installed plugin) in ``layouts`` (default:
    both) on 4 local gloo workers.

    :param budget_s: start no run after this many seconds; the runs left are reported as not
        run (their plugins as not judged there), never as passed.
    :param megatron_lm: a Megatron-LM checkout whose ``megatron`` the workers import instead of
        the installed one (a worker that imported another one fails its run, named).
    :raises ValueError: an unknown plugin or layout, a bad data file, or a folder that is not a
        Megatron-LM checkout of a served line.
    """
    from titan_plugins.testing.activation import environ
    from titan_plugins.testing.training_runs import CHECKOUT_ENV, run_task
    from titan_plugins.testing.workers import GlooWorkerPool

    plugins = chosen(names)
    names = list(plugins)
    layouts = list(LAYOUTS) if layouts is None else list(layouts)
    bad = [layout for layout in layouts if layout not in LAYOUTS]
    if bad:
        raise ValueError(f"unknown layout {bad[0]!r}; layouts: {', '.join(LAYOUTS)}")
    checkout_dir = checkout(megatron_lm) if megatron_lm else None
    declared = specs(plugins)
    wire = {n: {"config": d.config, "env": d.env} for n, d in declared.items()}
    started = time.monotonic()
    per_layout: dict[str, list[dict[str, Any]]] = {}
    failures: list[str] = []
    not_run: list[tuple[str, str]] = []
    # spawned workers start with this process's sys.path; the fork server of a preloaded pool
    # reads the checkout from CHECKOUT_ENV (it does not take the parent's sys.path)
    with _on_sys_path(checkout_dir), environ({CHECKOUT_ENV: checkout_dir} if checkout_dir else {}):
        forked = _start_fork_server()
        for layout, name, on in plan_runs(names, layouts, declared):
            if budget_s is not None and time.monotonic() - started > budget_s:
                not_run.append((layout, name))
                continue
            # a fresh job per run, as a user's is: no plugin state (one-shot captures,
            # counters, caches) survives from one run into the next; WORKER_ENV turns the
            # automatic channel off, so each run applies exactly its plugins. Forked from a
            # server that imported megatron once: 17 jobs x 4 workers x ~7 s of imports on 2
            # cores was most of the default check's differential part
            try:
                with GlooWorkerPool(WORLD_SIZE, preloaded=True) as pool:
                    if not forked:  # spawned from here: they must start shielded too
                        with interrupt.shielded():
                            pool.start()
                    ranks = pool.run(
                        run_task,
                        LAYOUTS[layout],
                        [(name, on)],
                        wire,
                        checkout_dir,
                        timeout=timeout_s,
                    )
            except Exception as err:  # a crashed or hung run fails the check, named
                failures.append(f"{layout}: {str(err).splitlines()[0]}")
                continue
            merged = per_layout.setdefault(layout, [{} for _ in ranks])
            for into, found in zip(merged, ranks):
                into.update(found)
    verdicts, all_on, problems = judge(per_layout, names, declared, not_run)
    result = DifferentialResult(verdicts, all_on, failures + problems, time.monotonic() - started)
    result.not_run = [f"{layout} {name}" for layout, name in not_run]
    result.megatron = _megatron_seen(per_layout)
    return result


def _start_fork_server() -> bool:
    """Start the preloaded pools' fork server now, with SIGINT blocked: the server and every
    worker it forks keep the block, so a terminal's Ctrl-C reaches verify alone, which stops them
    all (:mod:`~titan_plugins.verify.interrupt`) instead of each worker printing its own
    ``KeyboardInterrupt`` (or, forked after verify stopped waiting, outliving it). False when the
    pools will spawn their workers instead (another fork server runs already).

    multiprocessing's resource tracker starts first, outside the block: its start unblocks SIGINT
    in the caller after spawning (CPython bpo-33613), which inside the block would let the fork
    server start unshielded.
    """
    from multiprocessing import resource_tracker

    from titan_plugins.testing import workers

    resource_tracker.ensure_running()
    with interrupt.shielded():
        # workers.py's own start (the preload, the workers' environment, the sys.path it keeps);
        # it offers no public one. Returns None when this process cannot use a preloaded server
        return workers._fork_server() is not None


def checkout(path: str) -> str:
    """The checkout folder, checked: it must hold ``megatron/core/package_info.py`` of a line the
    plugins serve (the Megatron room's ``SUPPORTED``).

    :raises ValueError: not a checkout, or a version outside the served lines (one line each).
    """
    folder = Path(path).expanduser().resolve()
    info = folder / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise ValueError(
            f"{path}: not a Megatron-LM checkout (no megatron/core/package_info.py); pass the "
            "folder that holds megatron/ and pretrain_gpt.py"
        )
    host = HOSTS["megatron"]
    version = origin.read_package_info(info)
    if version is None:
        raise ValueError(f"{info}: no version found (MAJOR, MINOR, PATCH); is it a checkout?")
    if gates.judge_version(host.SUPPORTED, version).reason:
        raise ValueError(
            f"{path}: megatron-core {version} is outside the lines the plugins serve "
            f"({', '.join(host.MEGATRON_LINES)}); check out one of them, e.g. "
            f"core_v{host.MEGATRON_LINES[-1]}.0"
        )
    return str(folder)


@contextlib.contextmanager
def _on_sys_path(folder: str | None) -> Iterator[None]:
    if folder is None:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)


def _megatron_seen(per_layout: dict[str, list[dict[str, Any]]]) -> str:
    """Which Megatron the workers trained with (their ``megatron.core`` version and folder)."""
    seen = {
        rank.get("megatron", "")
        for ranks in per_layout.values()
        for rank in ranks
        if rank.get("megatron")
    }
    return "; ".join(sorted(seen)) or "unknown (no run finished)"
