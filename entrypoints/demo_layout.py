"""The CPU demo's parallel layout: which PP x EP (x VPP) fits the number of processes.

``scripts/demo.sh`` runs :func:`preflight` once, before torchrun starts any worker, so a layout
that cannot run, or an argument ``demo_args.check`` refuses, is refused in one line (not one
traceback per rank from inside Megatron), and a layout the user left open is chosen to fit
``NPROC``. The workers receive the resolved flags.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

# With the layout left open, the demo prefers the one that exercises the most plugins: PP=2 x
# EP=2 needs 4 processes (every plugin acts); with 2, PP=2 keeps the pipeline plugins
# (pp_rdma, act_offload) acting, and EP=2 the MoE dispatch one; pipelines are the demo's core.
_PREFERRED = ((2, 2), (2, 1), (1, 2), (1, 1))


class LayoutError(ValueError):
    """A layout the demo cannot run with the given number of processes (one line, with a fix)."""


@dataclass(frozen=True)
class Layout:
    """Pipeline, expert and virtual-pipeline sizes of the demo (TP is always 1 here)."""

    pp: int
    ep: int
    vpp: int | None

    def flags(self) -> list[str]:
        """The demo's command-line flags for this layout."""
        out = ["--pp", str(self.pp), "--ep", str(self.ep)]
        return out + (["--vpp", str(self.vpp)] if self.vpp else [])

    @property
    def tp_x_ep(self) -> int:
        """Megatron's flex dispatcher needs TP x EP > 1 (``MoEFlexTokenDispatcher``)."""
        return self.ep  # the demo runs TP=1


def resolve(nproc: int, pp: int | None, ep: int | None, vpp: int | None, experts: int) -> Layout:
    """The layout to run on ``nproc`` processes; ``None`` sizes are chosen to fit.

    Megatron needs the world size to be a multiple of PP x EP (TP=1, expert-TP=1), the experts to
    split evenly over EP, and VPP only with PP > 1. Raises :class:`LayoutError` naming the flags.
    """
    if nproc < 1:
        raise LayoutError(f"demo: NPROC={nproc}: run at least one process")
    for name, value in (("--pp", pp), ("--ep", ep), ("--vpp", vpp)):
        if value is not None and value < 1:
            raise LayoutError(f"demo: {name} {value}: sizes are positive integers")
    if vpp is not None and vpp > 1 and (pp or 2) < 2:
        raise LayoutError(
            f"demo: --vpp {vpp} needs --pp 2 or more (virtual stages split a pipeline)"
        )
    candidates = [
        (p, e)
        for p, e in _PREFERRED + ((pp or 1, ep or 1),)
        if (pp is None or p == pp) and (ep is None or e == ep)
    ]
    fitting = [(p, e) for p, e in candidates if nproc % (p * e) == 0 and experts % e == 0]
    interleaved = vpp is not None and vpp > 1
    for p, e in fitting:
        if p > 1 or not interleaved:
            return Layout(p, e, vpp if interleaved else None)
    asked = " x ".join(
        f"{flag} {value}" for flag, value in (("--pp", pp), ("--ep", ep)) if value is not None
    )
    fits = [f"--pp {p} --ep {e}" for p, e in _PREFERRED if nproc % (p * e) == 0][:2]
    if fitting:  # only the virtual stages stand in the way
        raise LayoutError(
            f"demo: --vpp {vpp} needs PP >= 2, so an even NPROC, got NPROC={nproc}; "
            f"drop --vpp, or run NPROC=2 or NPROC=4"
        )
    if pp is not None and ep is not None and experts % ep == 0:
        why = f"needs a multiple of {pp * ep} processes (PP x EP), got NPROC={nproc}"
    elif ep is not None and experts % ep:
        why = f"cannot split the demo's {experts} experts over EP={ep}"
    else:
        why = f"does not fit NPROC={nproc}"
    raise LayoutError(
        f"demo: {asked or 'the layout'} {why}; run with {' or '.join(fits) or '--pp 1 --ep 1'}"
        f" on NPROC={nproc}, or set NPROC to a multiple of PP x EP"
    )


def preflight(argv: list[str]) -> int:
    """``demo_layout.py NPROC ARGS...``: print the demo's arguments with the layout resolved
    (shell-quoted, one line) and return 0, or print one line naming the fix and return 2."""
    from titan_entrypoints.cpu_demo import EXPERTS, parse_args
    from titan_entrypoints.demo_args import DemoArgsError, check

    if not argv or not argv[0].isdigit():
        print("demo: NPROC must be a positive integer", file=sys.stderr)
        return 2
    nproc = int(argv[0])
    args = parse_args(argv[1:], prog="scripts/demo.sh")  # argparse: one-line error, exit 2
    try:
        check(args)  # steps, fault and trace steps, the report's path
        layout = resolve(nproc, args.pp, args.ep, args.vpp, EXPERTS)
    except (DemoArgsError, LayoutError) as err:
        print(err, file=sys.stderr)
        return 2
    rest = _without_layout_flags(argv[1:])
    print(shlex.join(layout.flags() + rest))
    return 0


def _without_layout_flags(argv: list[str]) -> list[str]:
    """``argv`` less ``--pp N`` / ``--ep N`` / ``--vpp N`` (either spelling, ``--pp=N`` too)."""
    out: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in ("--pp", "--ep", "--vpp"):
            skip = True
            continue
        if word.split("=", 1)[0] in ("--pp", "--ep", "--vpp") and "=" in word:
            continue
        out.append(word)
    return out


def _import_from_the_checkout() -> None:
    """``scripts/demo.sh`` runs this file before the venv (and so ``titan_entrypoints``) may
    exist: import this directory under the installed package's name; it needs only the
    standard library up to the layout check."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("titan_entrypoints") is not None:
        return
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location(
        "titan_entrypoints", here / "__init__.py", submodule_search_locations=[str(here)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["titan_entrypoints"] = package
    spec.loader.exec_module(package)


if __name__ == "__main__":
    _import_from_the_checkout()
    sys.exit(preflight(sys.argv[1:]))
