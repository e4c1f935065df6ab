"""The check behind the ``line_independent`` marker: such a test imports no megatron and starts
no process that does, so ``scripts/test.sh`` runs it on one Megatron line only.

A claim made by hand would rot: a test marked today may reach megatron after tomorrow's change,
and then silently run on one line. So the claim is checked on every run of a marked test:

- **In the test's own process**, megatron is hidden for the test: every ``megatron`` module, and
  every module of this tree that holds megatron objects (``tiny_gpt``, a test file importing
  megatron at its top), is taken out of ``sys.modules`` (collection or an earlier test may have
  imported them) and a finder refuses to import megatron, so the test sees what it would see
  alone. An attempt fails the test, even one the code caught. A marked test whose own module
  holds megatron objects fails at once. Everything is put back after the test.
- **In the processes it starts**, a probe (``_line_probe/install.py``) writes one record into a
  session folder when a process first imports megatron; a record that appears while a marked
  test runs fails that test. Every Python child of the test venv runs the probe through a
  ``.pth`` file the session puts into the venv (inert unless ``_TITAN_LINE_PROBE_DIR`` is set),
  and children of other venvs (``freshenv``) through the probe's ``sitecustomize`` on
  ``PYTHONPATH``. The folder's variable does not start with ``TITAN_``, so the tests' usual
  ``TITAN_*``-free environments keep it; a child given an environment built from scratch,
  without it, is outside the check, and a marked test must not start such children.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

MARKER = "line_independent"
RECORD_DIR_VAR = "_TITAN_LINE_PROBE_DIR"  # where children record their megatron imports
PROBE_DIR = Path(__file__).resolve().parent / "_line_probe"  # the probe and its sitecustomize
PTH_NAME = "titan_line_probe.pth"


class MegatronImportRefused(ImportError):
    """A ``line_independent`` test tried to import megatron."""


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def holds_megatron(module: ModuleType) -> bool:
    """Whether a module's globals hold a megatron module, class or function (a module-level
    ``import megatron...`` or ``from megatron... import x``)."""
    for value in list(vars(module).values()):
        owner = (
            value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
        )
        if isinstance(owner, str) and _is_megatron(owner):
            return True
    return False


def megatron_bound(root: Path) -> set[str]:
    """The modules imported from files under ``root`` (this tree: the core, the plugins, the
    test files) whose globals hold megatron objects."""
    bound = set()
    prefix = str(root) + os.sep
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        # a venv inside the tree holds torch and the rest: installed code, not this tree's
        ours = path.startswith(prefix) and f"{os.sep}site-packages{os.sep}" not in path
        if ours and not _is_megatron(name) and holds_megatron(module):
            bound.add(name)
    return bound


class MegatronGuard:
    """A ``sys.meta_path`` finder, first on the path while a marked test runs, that refuses
    megatron and remembers every attempt (code may catch the ImportError and go on), and every
    task sent to a process that has megatron imported already (``note_megatron_use``)."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.attempts: list[str] = []

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        """Refuse ``megatron`` and its submodules; leave every other import to the next finder."""
        if _is_megatron(name):
            self.attempts.append(name)
            raise MegatronImportRefused(
                f"{self.test} is marked {MARKER} but imports {name}: a test that imports megatron "
                f"runs on every Megatron line, so remove the {MARKER} marker"
            )
        return None


_ACTIVE: list[MegatronGuard] = []  # the guard of the marked test running now, if any


def note_megatron_use(what: str) -> None:
    """Tell the guard of a running marked test that it reached megatron through ``what``: a
    long-lived process that imported megatron before the test (a session's gloo worker pool)
    imports nothing new, so its probe has nothing to record."""
    for guard in _ACTIVE:
        guard.attempts.append(what)


@contextlib.contextmanager
def megatron_hidden(test: str, root: Path) -> Iterator[MegatronGuard]:
    """Inside the block megatron (and every module under ``root`` holding it) is not imported
    and megatron cannot be; afterwards ``sys.modules`` holds the same modules as before, and
    none of those the block imported. Yields the guard, whose ``attempts`` tell what was tried."""
    names = {name for name in sys.modules if _is_megatron(name)} | megatron_bound(root)
    hidden: dict[str, ModuleType] = {name: sys.modules.pop(name) for name in names}
    # ``from package import module`` reads the package's attribute before sys.modules
    detached = []
    for name, module in hidden.items():
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None and getattr(parent, child, None) is module:
            delattr(parent, child)
            detached.append((parent, child, module))
    guard = MegatronGuard(test)
    sys.meta_path.insert(0, guard)
    _ACTIVE.append(guard)
    try:
        yield guard
    finally:
        _ACTIVE.remove(guard)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(guard)
        for name in [name for name in sys.modules if _is_megatron(name) or name in hidden]:
            del sys.modules[name]  # what the block imported in their place: not ours to keep
        sys.modules.update(hidden)
        for parent, child, module in detached:
            setattr(parent, child, module)


def _pth_line() -> str:
    # ``site`` runs a .pth line that starts with ``import``; ``os`` is imported by then, so
    # without the variable the line costs one lookup
    install = PROBE_DIR / "install.py"
    return (
        f"import os; exec(compile(open({str(install)!r}).read(), {str(install)!r}, 'exec')) "
        f"if os.environ.get({RECORD_DIR_VAR!r}) else None\n"
    )


def install_pth(site_packages: Path) -> bool:
    """Put the probe's ``.pth`` into ``site_packages`` (the test venv's) unless it is there;
    False where the folder cannot be written (the ``PYTHONPATH`` hook still serves)."""
    pth = site_packages / PTH_NAME
    line = _pth_line()
    with contextlib.suppress(OSError):
        if pth.read_text() == line:
            return True
    try:
        partial = pth.with_name(f".{PTH_NAME}.{os.getpid()}")
        partial.write_text(line)
        partial.replace(pth)  # whole, for the interpreters that start meanwhile
    except OSError:
        return False
    return True


def start_child_probe() -> Path:
    """Arm the child-process probe for this session: a fresh record folder, named in the
    environment, the probe's ``.pth`` in this venv and its folder on ``PYTHONPATH``. Returns
    the folder."""
    import sysconfig

    site_packages = Path(sysconfig.get_paths()["purelib"])
    if not install_pth(site_packages):
        import warnings

        # the check still runs, narrower: children that set their own PYTHONPATH go unseen
        warnings.warn(
            f"line_independent guard: cannot write {PTH_NAME} into {site_packages}; only "
            "children that inherit PYTHONPATH are probed for megatron imports",
            stacklevel=2,
        )
    records = Path(tempfile.mkdtemp(prefix="titan-line-probe-"))
    os.environ[RECORD_DIR_VAR] = str(records)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(PROBE_DIR), *rest])
    return records


def child_records(records: Path) -> set[str]:
    """The names of the records written so far (one per process that imported megatron)."""
    with contextlib.suppress(FileNotFoundError):
        return {path.name for path in records.iterdir()}
    return set()


def describe_records(records: Path, names: set[str]) -> str:
    """One line per record: the process and the command that imported megatron."""
    lines = []
    for name in sorted(names):
        with contextlib.suppress(OSError):
            lines.append(f"  pid {name}: {(records / name).read_text().strip()[:300]}")
    return "\n".join(lines)
