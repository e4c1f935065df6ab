"""Every distribution says which Megatron-LM unit tests exercise its patches (issue 31 item 3).

Each plugin package, the template and the core's Megatron room ship ``upstream_tests.json``
(:mod:`titan_plugins.verify.selection`). Here: every patch record is covered by at least one
selected file or listed in ``not_covered`` with a reason, and no entry names an id that no record
has (stale); the file is package data in the distribution's ``setup.cfg``; a bad data file raises
an error naming the file and the field.

The data files are read by path from this checkout (``ROOT / "plugins" / ...``), not through the
installed packages: the venv holds editable installs of one checkout, which need not be the one
under test (a second worktree reads the first one's files through them). The records come from
the installed entry points, as tests/test_core_ledger.py gets them (nothing imports megatron);
a plugin whose records depend on a list knob registers them once with the defaults and once with
every choice of each such knob, and the data file must account for all of them.

Opt-in: with ``MEGATRON_LM_DIR`` set to a Megatron-LM checkout, every selected file exists in it
unless every record the file covers is gated off the checkout's line (e.g. a test file that
arrived with the 0.17 line and covers only a 0.17+ patch).
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from titan_plugins.hosts import megatron as megatron_room
from titan_plugins.manager import ENTRY_POINT_GROUP
from titan_plugins.patching import Patch, gates
from titan_plugins.patching.origin import read_package_info
from titan_plugins.testing import environ
from titan_plugins.verify import selection
from titan_plugins.verify.selection import DATA_FILE, Selection, SelectionError, UpstreamTest

# imports no megatron and starts no process that does: one line runs it (checked)
pytestmark = pytest.mark.line_independent

ROOT = Path(__file__).resolve().parents[1]
SUITE = "megatron_lm_tests"
CORE = "core"
CORE_PACKAGE = "titan_plugins.hosts.megatron"
PLUGIN_DIRS = {p.parent.name: p.parent for p in sorted(ROOT.glob("plugins/*/setup.cfg"))}
DISTRIBUTIONS = [CORE, *PLUGIN_DIRS]  # "_template" included: its example file is checked too


def package_of(name: str) -> str:
    """The import package that ships the distribution's data file."""
    if name == CORE:
        return CORE_PACKAGE
    (package,) = [
        p.name
        for p in PLUGIN_DIRS[name].iterdir()
        if (p / "__init__.py").is_file() and p.name != "tests"
    ]
    return package


def data_file(name: str) -> Path:
    """This checkout's data file of the distribution."""
    if name == CORE:
        return ROOT / Path(*CORE_PACKAGE.split(".")) / DATA_FILE
    return PLUGIN_DIRS[name] / package_of(name) / DATA_FILE


def _registered(plugin: object) -> list[Patch]:
    records: list[Patch] = []
    register = getattr(plugin, "titan_register_patches", None)
    if register is not None:
        register(register=records.append)
    return records


def _knob_variants(plugin: object) -> list[dict[str, str]]:
    """The defaults, and (when the plugin has list knobs with choices) every choice at once."""
    settings = getattr(plugin, "titan_settings", lambda: [])()
    every = {s.name: ",".join(s.choices) for s in settings if s.type is list and s.choices}
    return [{}, every] if every else [{}]


def records_of(name: str) -> list[Patch]:
    """Every patch record the distribution can register (ids unique, first-seen order)."""
    if name == CORE:
        return megatron_room.core_patches()
    if name == "_template":  # not installed: its patches module imports only the core
        path = PLUGIN_DIRS[name] / package_of(name) / "patches.py"
        spec = importlib.util.spec_from_file_location("_titan_template_patches", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.patches()
    found = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    assert found, f"plugin {name} is not installed (./scripts/bootstrap.sh installs every plugin)"
    plugin = found[0].load()
    records: dict[str, Patch] = {}
    for env in _knob_variants(plugin):
        with environ(env):
            for record in _registered(plugin):
                records.setdefault(record.id, record)
    return list(records.values())


# ------------------------------------------------------------------------- the shipped files
@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_every_patch_is_covered_by_a_selected_file_or_says_why_not(name):
    chosen = selection.read(data_file(name))
    records = records_of(name)
    coverage = chosen.coverage(records)
    assert coverage.problems() == [], f"{data_file(name).relative_to(ROOT)}"
    assert set(coverage.covered) | set(coverage.not_covered) == {r.id for r in records}
    assert {t.suite for t in chosen.tests} <= {SUITE}


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_the_data_file_is_package_data(name):
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg" if name == CORE else PLUGIN_DIRS[name] / "setup.cfg")
    assert DATA_FILE in cfg["options.package_data"].get(package_of(name), "").split()


def test_plugins_record_knob_dependent_patches_too():
    # act_offload registers one record per configured block: the file covers every block
    ids = {r.id for r in records_of("act_offload")}
    assert "act_offload.block.layer.TransformerLayer.forward" in ids  # not a default block


def test_load_finds_the_data_file_through_the_package():
    import titan_plugins

    assert Path(titan_plugins.__file__).is_relative_to(ROOT), "run from the checkout under test"
    loaded, read = selection.load(CORE_PACKAGE), selection.read(data_file(CORE))
    assert (loaded.tests, loaded.not_covered) == (read.tests, read.not_covered)
    assert loaded.source == f"{CORE_PACKAGE}/{DATA_FILE}"


def test_load_and_read_name_a_missing_file(tmp_path):
    with pytest.raises(SelectionError, match=rf"^titan_plugins\.plan: no {DATA_FILE} in the"):
        selection.load("titan_plugins.plan")
    with pytest.raises(SelectionError, match=r"^no_such_package: no "):
        selection.load("no_such_package")
    with pytest.raises(SelectionError, match=rf"^{tmp_path}/x.json: cannot read it"):
        selection.read(tmp_path / "x.json")


# ------------------------------------------------------------------------- the checks
A = "tests/unit_tests/test_a.py"


def entry(**fields: object) -> str:
    return json.dumps({SUITE: {A: {"covers": ["p.x"], **fields}}})


BAD = [  # (id, file text, what the message says after the file name)
    ("json", "{", "not valid JSON: Expecting property name"),
    ("top", "[]", "top level: must be a JSON object, not a list"),
    ("key", '{"megatron_tests": {}}', "'megatron_tests': unknown key; accepted keys: megatron_lm"),
    ("twice", '{"not_covered": {}, "not_covered": {}}', "key 'not_covered' appears twice"),
    ("suite", json.dumps({SUITE: []}), f"{SUITE}: must be an object of test file -> entry"),
    ("abs", json.dumps({SUITE: {"/" + A: {}}}), f"{SUITE}['/{A}']: a relative path"),
    ("dotdot", json.dumps({SUITE: {"tests/unit_tests/../test_a.py": {}}}), "no '.', '..'"),
    ("backslash", json.dumps({SUITE: {A.replace("/", "\\"): {}}}), "a relative path"),
    ("outside", json.dumps({SUITE: {"tests/functional_tests/test_a.py": {}}}), "must be under"),
    ("txt", json.dumps({SUITE: {"tests/unit_tests/test_a.txt": {}}}), "must name a test file"),
    ("helper", json.dumps({SUITE: {"tests/unit_tests/utils.py": {}}}), "must name a test file"),
    ("entry", json.dumps({SUITE: {A: ["p.x"]}}), f"{SUITE}['{A}']: must be an object"),
    ("no-covers", json.dumps({SUITE: {A: {}}}), f"{SUITE}['{A}'].covers: missing"),
    ("empty-covers", json.dumps({SUITE: {A: {"covers": []}}}), ".covers: must be a non-empty"),
    ("str-covers", json.dumps({SUITE: {A: {"covers": "p.x"}}}), ".covers: must be a non-empty"),
    ("int-id", json.dumps({SUITE: {A: {"covers": ["p.x", 3]}}}), ".covers[1]: must be a patch id"),
    ("space-id", json.dumps({SUITE: {A: {"covers": ["p x"]}}}), ".covers[0]: must be a patch id"),
    ("twice-id", json.dumps({SUITE: {A: {"covers": ["p.x"] * 2}}}), ".covers: names an id twice"),
    ("field", entry(cover=["p.y"]), f"{SUITE}['{A}'].cover: unknown field; fields: covers"),
    ("ws-int", entry(world_sizes=8), ".world_sizes: must be a list of process counts"),
    ("ws-zero", entry(world_sizes=[0]), ".world_sizes[0]: must be a whole number >= 1: 0"),
    ("ws-bool", entry(world_sizes=[True]), ".world_sizes[0]: must be a whole number >= 1: True"),
    ("ws-str", entry(world_sizes=["8"]), ".world_sizes[0]: must be a whole number >= 1: '8'"),
    ("ws-order", entry(world_sizes=[8, 1]), ".world_sizes: must be ascending, each size once"),
    ("reads-empty", json.dumps({SUITE: {A: {"reads": " "}}}), f"{SUITE}['{A}'].reads: must say"),
    ("reads-list", json.dumps({SUITE: {A: {"reads": ["x"]}}}), ".reads: must say, in words"),
    ("nc-list", json.dumps({"not_covered": []}), "not_covered: must be an object of patch id"),
    ("nc-empty", json.dumps({"not_covered": {"p.x": " "}}), "not_covered['p.x']: say why"),
    ("nc-int", json.dumps({"not_covered": {"p.x": 1}}), "not_covered['p.x']: say why"),
    ("nc-id", json.dumps({"not_covered": {" p.x": "r"}}), "not_covered[' p.x']: must be a patch"),
    (
        "both",
        json.dumps({SUITE: {A: {"covers": ["p.x"]}}, "not_covered": {"p.x": "r"}}),
        f"not_covered['p.x']: the id is also covered by {A}",
    ),
]


@pytest.mark.parametrize(("text", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_data_file_names_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / DATA_FILE
    path.write_text(text)
    with pytest.raises(SelectionError) as raised:
        selection.read(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert message in str(raised.value)


def test_a_good_data_file_parses_every_field(tmp_path):
    path = tmp_path / DATA_FILE
    path.write_text(
        json.dumps(
            {
                SUITE: {A: {"covers": ["p.x", "p.y"], "world_sizes": [1, 8]}},
                "not_covered": {"p.z": "only training.py builds it"},
            }
        )
    )
    chosen = selection.read(path)
    assert chosen.source == str(path)
    assert chosen.tests == (UpstreamTest(SUITE, A, ("p.x", "p.y"), (1, 8)),)
    assert chosen.not_covered == {"p.z": "only training.py builds it"}


def test_coverage_answers_covered_not_covered_gaps_and_stale():
    b = "tests/unit_tests/sub/test_b.py"
    chosen = Selection(
        "mem",
        (UpstreamTest(SUITE, A, ("p.x", "p.y")), UpstreamTest(SUITE, b, ("p.y", "p.old"))),
        {"p.z": "why", "p.gone": "why"},
    )
    records = [SimpleNamespace(id=i) for i in ("p.x", "p.y", "p.z", "p.new")]
    coverage = chosen.coverage(records)
    assert coverage.covered == {"p.x": (A,), "p.y": (A, b)}
    assert coverage.not_covered == {"p.z": "why"}
    assert coverage.gaps == ("p.new",)
    assert coverage.stale == ("p.gone", "p.old")
    assert coverage.problems() == [
        "p.new: no selected file covers it and not_covered does not say why",
        "p.gone: named in the data file, but no patch record has this id",
        "p.old: named in the data file, but no patch record has this id",
    ]
    assert chosen.files(SUITE) == [A, b]
    assert chosen.files(SUITE, ["p.old"]) == [b]
    assert chosen.files(SUITE, ["p.z"]) == []
    assert chosen.files("other_suite") == []


# ------------------------------------------------------------------------- a real checkout
CHECKOUT = Path(os.environ.get("MEGATRON_LM_DIR", "/nonexistent"))
VERSION = read_package_info(CHECKOUT / "megatron" / "core" / "package_info.py")


@pytest.mark.megatron_lm
@pytest.mark.skipif(
    not (CHECKOUT / "tests" / "unit_tests").is_dir() or VERSION is None,
    reason="set MEGATRON_LM_DIR to a Megatron-LM checkout (core_v0.16.1 .. core_v0.19.x) to "
    "check that the selected test files exist in it",
)
@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_selected_files_exist_in_the_megatron_lm_checkout(name):
    gated = {r.id: r.requires for r in records_of(name)}

    def serves(patch_id: str) -> bool:  # the record applies to the checkout's line
        requires = gated.get(patch_id, ())
        return all(gates.judge_version(g, VERSION).reason is None for g in requires)

    chosen = selection.read(data_file(name))
    missing = [
        f"{test.path} (covers {', '.join(i for i in test.covers if serves(i))})"
        for test in chosen.tests
        if any(serves(i) for i in test.covers) and not (CHECKOUT / test.path).is_file()
    ]
    assert missing == [], f"not in {CHECKOUT} (megatron-core {VERSION})"


def test_a_plugin_that_only_reads_the_host_selects_files_by_what_it_reads(tmp_path):
    # weight_sync patches nothing of Megatron; its trainer side reads Megatron's parallel
    # state and parameter layouts, and is judged on the files that test those.
    path = tmp_path / DATA_FILE
    path.write_text(json.dumps({SUITE: {A: {"reads": "parallel state", "world_sizes": [8]}}}))
    found = selection.read(path)
    (test,) = found.tests
    assert (test.path, test.covers, test.reads, test.world_sizes) == (A, (), "parallel state", (8,))
    assert found.coverage([]).problems() == []
