"""Which upstream tests exercise each patch: a distribution's ``upstream_tests.json``.

Every distribution that registers patches (each plugin, and the core for its own host patches)
ships this data file inside its package. Per upstream test suite (a key of a host room's
``UPSTREAM_TESTS``, e.g. ``megatron_lm_tests``: files under a Megatron-LM checkout's
``tests/unit_tests/``) it names the test files whose tests call the patches' targets, and, for a
patch that no such file exercises, why not::

    {
      "megatron_lm_tests": {
        "tests/unit_tests/transformer/test_mlp.py": {"covers": ["my_plugin.mlp_forward"],
                                                     "world_sizes": [1]}
      },
      "not_covered": {"my_plugin.cuda_graph": "only megatron/training builds it, on CUDA"}
    }

``covers`` lists patch record ids (``Patch.id``); ``world_sizes`` (optional) the numbers of
processes the file's tests are written for, ascending. A plugin that patches nothing of the
host but reads it (weight_sync's trainer side reads Megatron's parallel state and parameter
layouts) selects the files that test what it reads with ``reads`` (what, in words) in place of
``covers``: those tests run with it on and off like any other, and it is judged on them.

An optional ``differential`` object says how ``titan-plugins verify``'s differential training
check (:mod:`~titan_plugins.verify.differential`) runs and judges the plugin: ``config``
(``TransformerConfig`` fields its code path needs, e.g. ``{"fp8": "e4m3"}``), ``env`` (its knobs
for the check), ``loss_bound`` / ``norm_bound`` (the largest relative per-step gap of the loss and
of the grad norm from the run with every plugin off: 0 means bit-identical, the default) and
``outside_the_step`` (why the plugin counts no work in a training step, when it does not) and
``not_in_layouts`` (layout -> why the plugin cannot run in it, e.g. Megatron's own refusal). Every field is checked when the file is
read; a bad one raises :class:`SelectionError` naming the file and the field.
:meth:`Selection.coverage` answers, for a list of patch records, which are covered by which
files, which are not covered and why, and which are neither (gaps) or named but absent (stale).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from titan_plugins.hosts import HOSTS

if TYPE_CHECKING:
    from titan_plugins.patching.record import Patch

DATA_FILE = "upstream_tests.json"
NOT_COVERED = "not_covered"
DIFFERENTIAL = "differential"
_DIFFERENTIAL_FIELDS = (
    "config",
    "env",
    "loss_bound",
    "norm_bound",
    "outside_the_step",
    "not_in_layouts",
)
SUITES: dict[str, str] = {
    suite: folder for host in HOSTS.values() for suite, folder in host.UPSTREAM_TESTS.items()
}
"""Upstream test suite (the data file's key) -> the folder of a host checkout its files are in."""
_ENTRY_FIELDS = ("covers", "reads", "world_sizes")
_Bad = Callable[[str, str], Exception]  # (where, problem) -> the error to raise


class SelectionError(ValueError):
    """A data file that is missing, is not JSON, or has a bad field (the message names both)."""


@dataclass(frozen=True)
class UpstreamTest:
    """One selected test file: ``path`` relative to a checkout of the suite's repository."""

    suite: str
    path: str
    covers: tuple[str, ...]
    world_sizes: tuple[int, ...] = ()
    reads: str = ""
    """What of the host the plugin reads that these tests check (an entry without ``covers``)."""


@dataclass(frozen=True)
class Coverage:
    """A selection judged against patch records (ids in the records' order unless sorted).

    :param covered: record id -> the files that exercise it.
    :param not_covered: record id -> why no upstream test exercises it.
    :param gaps: record ids the data file says nothing about.
    :param stale: ids the data file names that no record has (sorted).
    """

    covered: dict[str, tuple[str, ...]]
    not_covered: dict[str, str]
    gaps: tuple[str, ...]
    stale: tuple[str, ...]

    def problems(self) -> list[str]:
        """One line per gap and per stale id; [] when the selection accounts for every record."""
        return [
            f"{patch_id}: no selected file covers it and not_covered does not say why"
            for patch_id in self.gaps
        ] + [
            f"{patch_id}: named in the data file, but no patch record has this id"
            for patch_id in self.stale
        ]


@dataclass(frozen=True)
class Differential:
    """How the differential training check runs and judges one plugin (all optional)."""

    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    loss_bound: float = 0.0
    norm_bound: float = 0.0
    outside_the_step: str = ""
    not_in_layouts: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Selection:
    """A parsed ``upstream_tests.json`` (``source``: where it was read, for messages)."""

    source: str
    tests: tuple[UpstreamTest, ...] = ()
    not_covered: dict[str, str] = field(default_factory=dict)
    differential: Differential = field(default_factory=Differential)

    def ids(self) -> set[str]:
        """Every patch id the data file names (covered or not)."""
        return {patch_id for test in self.tests for patch_id in test.covers} | set(self.not_covered)

    def files(self, suite: str, ids: Iterable[str] | None = None) -> list[str]:
        """The suite's selected files, in the data file's order; with ``ids``, only those that
        cover at least one of them (e.g. the records that apply on a given host line)."""
        wanted = None if ids is None else set(ids)
        return [
            test.path
            for test in self.tests
            if test.suite == suite and (wanted is None or wanted.intersection(test.covers))
        ]

    def coverage(self, records: Iterable[Patch]) -> Coverage:
        """Judge the selection against ``records`` (anything with an ``id``)."""
        ids = [record.id for record in records]
        covered: dict[str, tuple[str, ...]] = {}
        for patch_id in ids:
            paths = tuple(test.path for test in self.tests if patch_id in test.covers)
            if paths:
                covered[patch_id] = paths
        return Coverage(
            covered=covered,
            not_covered={
                patch_id: self.not_covered[patch_id]
                for patch_id in ids
                if patch_id in self.not_covered
            },
            gaps=tuple(
                patch_id
                for patch_id in ids
                if patch_id not in covered and patch_id not in self.not_covered
            ),
            stale=tuple(sorted(self.ids() - set(ids))),
        )


def load(package: str) -> Selection:
    """The data file shipped in ``package`` (e.g. ``titan_fp8_blockwise``), found through
    :mod:`importlib.resources` (the package is imported, not the plugin module)."""
    try:
        resource = resources.files(package).joinpath(DATA_FILE)
        text = resource.read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError) as err:
        raise SelectionError(
            f"{package}: no {DATA_FILE} in the package ({err.__class__.__name__}); a "
            "distribution that registers patches says which upstream tests exercise them "
            "(docs/core-api.md)"
        ) from None
    return parse_text(text, f"{package}/{DATA_FILE}")


def read(path: str | Path) -> Selection:
    """The data file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise SelectionError(f"{path}: cannot read it ({err.strerror or err})") from None
    return parse_text(text, str(path))


def parse_text(text: str, source: str) -> Selection:
    """Parse and check the JSON text of a data file (``source`` names it in errors)."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as err:
        raise SelectionError(f"{source}: key {err.args[0]!r} appears twice") from None
    except json.JSONDecodeError as err:
        raise SelectionError(
            f"{source}: not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})"
        ) from None
    return parse(data, source)


def parse(data: Any, source: str) -> Selection:
    """Check the decoded data of a data file field by field and build the :class:`Selection`."""

    def bad(where: str, problem: str) -> SelectionError:
        return SelectionError(f"{source}: {where}: {problem}")

    if not isinstance(data, dict):
        raise bad("top level", f"must be a JSON object, not {_kind(data)}")
    tests: list[UpstreamTest] = []
    not_covered: dict[str, str] = {}
    differential = Differential()
    accepted = [*SUITES, NOT_COVERED, DIFFERENTIAL]
    for key, value in data.items():
        if key == NOT_COVERED:
            not_covered = _not_covered(value, bad)
        elif key == DIFFERENTIAL:
            differential = _differential(value, bad)
        elif key in SUITES:
            tests += _suite(key, value, bad)
        else:
            raise bad(repr(key), f"unknown key; accepted keys: {', '.join(accepted)}")
    for test in tests:
        for patch_id in test.covers:
            if patch_id in not_covered:
                raise bad(
                    f"{NOT_COVERED}[{patch_id!r}]",
                    f"the id is also covered by {test.path}: say one or the other",
                )
    return Selection(source, tuple(tests), not_covered, differential)


def _differential(value: Any, bad: _Bad) -> Differential:
    if not isinstance(value, dict):
        raise bad(DIFFERENTIAL, f"must be an object, not {_kind(value)}")
    unknown = sorted(set(value) - set(_DIFFERENTIAL_FIELDS))
    if unknown:
        raise bad(
            f"{DIFFERENTIAL}.{unknown[0]}",
            f"unknown field; fields: {', '.join(_DIFFERENTIAL_FIELDS)}",
        )
    config = value.get("config", {})
    if not isinstance(config, dict) or not all(_is_patch_id(k) for k in config):
        raise bad(f"{DIFFERENTIAL}.config", "must be an object of TransformerConfig field -> value")
    env = value.get("env", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise bad(f"{DIFFERENTIAL}.env", "must be an object of variable -> string value")
    bounds = []
    for name in ("loss_bound", "norm_bound"):
        bound = value.get(name, 0.0)
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound < 1:
            raise bad(f"{DIFFERENTIAL}.{name}", f"must be a number in [0, 1): {bound!r}")
        bounds.append(float(bound))
    why = value.get("outside_the_step", "")
    if not isinstance(why, str):
        raise bad(f"{DIFFERENTIAL}.outside_the_step", "must be a string (why)")
    layouts = value.get("not_in_layouts", {})
    if not isinstance(layouts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in layouts.items()
    ):
        raise bad(f"{DIFFERENTIAL}.not_in_layouts", "must be an object of layout -> why")
    return Differential(dict(config), dict(env), bounds[0], bounds[1], why, dict(layouts))


def _suite(suite: str, value: Any, bad: _Bad) -> list[UpstreamTest]:
    if not isinstance(value, dict):
        raise bad(suite, f"must be an object of test file -> entry, not {_kind(value)}")
    tests = []
    for path, entry in value.items():
        where = f"{suite}[{path!r}]"
        why = _path_problem(path, SUITES[suite])
        if why:
            raise bad(where, why)
        if not isinstance(entry, dict):
            raise bad(where, f"must be an object with 'covers', not {_kind(entry)}")
        unknown = sorted(set(entry) - set(_ENTRY_FIELDS))
        if unknown:
            raise bad(f"{where}.{unknown[0]}", f"unknown field; fields: {', '.join(_ENTRY_FIELDS)}")
        reads = entry.get("reads", "")
        if not isinstance(reads, str) or ("reads" in entry and not reads.strip()):
            raise bad(f"{where}.reads", "must say, in words, what of the host the tests check")
        if "covers" not in entry and not reads:
            raise bad(
                f"{where}.covers",
                "missing: list the patch ids the file exercises (or, for a plugin that only "
                "reads the host, say what in 'reads')",
            )
        covers = _ids(entry["covers"], f"{where}.covers", bad) if "covers" in entry else ()
        world_sizes = _world_sizes(entry.get("world_sizes", []), f"{where}.world_sizes", bad)
        tests.append(UpstreamTest(suite, path, covers, world_sizes, reads))
    return tests


def _path_problem(path: str, folder: str) -> str | None:
    """Why ``path`` is not a test file of the suite's ``folder`` (None when it is)."""
    parts = PurePosixPath(path).parts
    if "\\" in path or path.startswith("/") or not parts:
        return "a relative path with '/' separators, e.g. tests/unit_tests/test_x.py"
    if any(part in (".", "..") for part in path.split("/")) or "" in path.split("/"):
        return "no '.', '..' or empty parts in the path"
    if not path.startswith(folder):
        return f"must be under {folder}"
    name = parts[-1]
    if not (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))):
        return "must name a test file (test_*.py or *_test.py)"
    return None


def _ids(value: Any, where: str, bad: _Bad) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise bad(where, f"must be a non-empty list of patch ids, not {_kind(value)}")
    for i, patch_id in enumerate(value):
        if not _is_patch_id(patch_id):
            raise bad(
                f"{where}[{i}]", f"must be a patch id (a string without spaces): {patch_id!r}"
            )
    if len(set(value)) != len(value):
        raise bad(where, "names an id twice")
    return tuple(value)


def _is_patch_id(value: Any) -> bool:
    """A patch record id: a non-empty string without spaces or surrounding whitespace."""
    return isinstance(value, str) and bool(value) and value == value.strip() and " " not in value


def _world_sizes(value: Any, where: str, bad: _Bad) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise bad(where, f"must be a list of process counts, not {_kind(value)}")
    for i, size in enumerate(value):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise bad(f"{where}[{i}]", f"must be a whole number >= 1: {size!r}")
    if value != sorted(set(value)):
        raise bad(where, "must be ascending, each size once")
    return tuple(value)


def _not_covered(value: Any, bad: _Bad) -> dict[str, str]:
    if not isinstance(value, dict):
        raise bad(NOT_COVERED, f"must be an object of patch id -> reason, not {_kind(value)}")
    for patch_id, reason in value.items():
        if not _is_patch_id(patch_id):
            raise bad(
                f"{NOT_COVERED}[{patch_id!r}]", "must be a patch id (a string without spaces)"
            )
        if not isinstance(reason, str) or not reason.strip():
            raise bad(
                f"{NOT_COVERED}[{patch_id!r}]",
                "say why no upstream test exercises it (a non-empty string)",
            )
    return dict(value)


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )
