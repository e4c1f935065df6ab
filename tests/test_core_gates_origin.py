"""Version truth from the imported code, and signature checks, on fake Megatron-like packages.

Each test builds a namespace package ``fakemeg_<n>`` with a ``core`` package (``package_info.py``
in megatron's layout and a ``layers.py`` target) in temporary folders, installed the ways
Megatron reaches users: a wheel (``.dist-info`` with a RECORD owning the files), an editable
install (``direct_url.json`` pointing at a source tree), a bare checkout on ``sys.path``, a
checkout shadowing a wheel, a copy bundled in another distribution, a pre-release and a fork
whose function signature changed. The gate ``fakemeg-<n>-core>=0.16,<0.17`` is resolved like
``megatron-core`` (through ``gates.VERSION_MODULES``).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from titan_plugins.hosts import megatron as megatron_room
from titan_plugins.patching import (
    APPLIED,
    PENDING,
    SKIPPED,
    Patch,
    PatchEngine,
    PatchError,
    PatchWatcher,
    Signature,
    gates,
    origin,
)

LAYERS = """
def linear(input, weight, bias=None, *, tp_group=None):
    out = input * weight
    if bias is not None:
        out = out + bias
    return out

class Linear:
    def _forward_impl(self, input, weight, *args, **kwargs):
        return linear(input, weight, *args, **kwargs)
"""
FORK_LAYERS = (  # a fork renamed the parameters the patch passes by keyword
    LAYERS.replace("def linear(input, weight,", "def linear(inp, w,").replace(
        "out = input * weight", "out = inp * w"
    )
)


class FakeMegatron:
    """Builds ``fakemeg_<n>.core`` trees and distributions under ``tmp``; cleans up after."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp, self.monkeypatch = tmp, monkeypatch
        self.top = f"fakemeg_{abs(hash(tmp)) % 10**8}"
        self.package = f"{self.top}.core"
        self.dist = f"{self.top.replace('_', '-')}-core"
        self.gate = f"{self.dist}>=0.16,<0.17"
        monkeypatch.setitem(gates.VERSION_MODULES, self.dist, self.package)

    def tree(self, where: str, version: str = "0.16.1", layers: str = LAYERS) -> Path:
        """Write ``<tmp>/<where>/fakemeg_n/core`` (namespace top, like megatron); return its
        sys.path root."""
        root = self.tmp / where
        core = root / self.top / "core"
        core.mkdir(parents=True)
        major, minor, patch, pre = re.match(r"(\d+)\.(\d+)\.(\d+)(.*)", version).groups()
        (core / "__init__.py").write_text("")
        (core / "package_info.py").write_text(
            f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = {pre!r}\n"
            "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n"
            "__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])\n"
        )
        (core / "layers.py").write_text(textwrap.dedent(layers))
        return root

    def dist_info(
        self, site: Path, name: str, version: str, owns: bool, editable: Path | None = None
    ) -> None:
        """A ``.dist-info`` in ``site``: RECORD lists the core files when ``owns``."""
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        files = [f"{self.top}/core/{f},," for f in ("__init__.py", "package_info.py", "layers.py")]
        (info / "RECORD").write_text("\n".join(files if owns else []) + "\n")
        if editable is not None:
            url = {"url": f"file://{editable}", "dir_info": {"editable": True}}
            (info / "direct_url.json").write_text(json.dumps(url))

    def on_path(self, *roots: Path) -> None:
        """Put ``roots`` first on sys.path, in this order."""
        for root in reversed(roots):
            self.monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()

    def layers(self):
        return importlib.import_module(f"{self.package}.layers")

    def cleanup(self) -> None:
        for name in [m for m in sys.modules if m == self.top or m.startswith(self.top + ".")]:
            del sys.modules[name]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made = FakeMegatron(tmp_path, monkeypatch)
    yield made
    made.cleanup()


def record(fake: FakeMegatron, pid: str = "p.linear", **kw) -> Patch:
    kw.setdefault("requires", (fake.gate,))
    return Patch(
        id=pid,
        target=f"{fake.package}.layers:linear",
        replace=lambda orig: lambda *a, **k: orig(*a, **k) * 10,
        rationale="test",
        remove_when="test",
        **kw,
    )


LINEAR_SIGNATURE = Signature(params=("input", "weight", "bias", "tp_group"))


def applied_through_watcher(fake: FakeMegatron, *patches: Patch) -> dict[str, tuple[str, str]]:
    """Register before the module exists in sys.modules, import it, report the statuses."""
    engine = PatchEngine()
    watcher = PatchWatcher(engine)
    watcher.install()
    try:
        for patch in patches:
            engine.register(patch)
            assert patch.status == PENDING  # judged at import of the target, not now
        assert f"{fake.package}.layers" not in sys.modules  # registering imported nothing
        layers = fake.layers()
        result = {p.id: (p.status, p.detail) for p in engine.patches()}
        result["value"] = (str(layers.linear(2, 3)), "")
        return result
    finally:
        engine.undo()
        watcher.remove()


# ------------------------------------------------------------------- where the code comes from
def test_wheel(fake, tmp_path):
    site = fake.tree("site")
    fake.dist_info(site, fake.dist, "0.16.1", owns=True)
    fake.on_path(site)
    found = origin.describe(fake.package, fake.dist)
    assert (found.kind, found.version, found.shadowed) == ("distribution", "0.16.1", ())
    assert found.distribution == f"{fake.dist} 0.16.1" and found.path == str(
        site / fake.top / "core"
    )
    status = applied_through_watcher(fake, record(fake, signature=LINEAR_SIGNATURE))
    assert status["p.linear"][0] == APPLIED and status["value"][0] == "60"


def test_editable(fake, tmp_path):
    source = fake.tree("src")
    site = tmp_path / "site"
    fake.dist_info(site, fake.dist, "0.16.1", owns=False, editable=source)
    fake.on_path(site, source)  # what the editable install's .pth / finder adds
    found = origin.describe(fake.package, fake.dist)
    assert (found.kind, found.version) == ("editable", "0.16.1")
    assert str(source) in found.distribution and not found.shadowed
    assert applied_through_watcher(fake, record(fake))["p.linear"][0] == APPLIED


def test_bare_checkout_without_distribution_applies(fake):
    """The issue's first case: a checkout on PYTHONPATH, no distribution metadata at all."""
    checkout = fake.tree("checkout")
    fake.on_path(checkout)
    assert gates.installed_version(fake.dist) is None  # metadata alone would skip every patch
    found = origin.describe(fake.package, fake.dist)
    assert (found.kind, found.version, found.distribution) == ("checkout", "0.16.1", None)
    status = applied_through_watcher(
        fake, record(fake), record(fake, "p.sig", signature=LINEAR_SIGNATURE)
    )
    assert status["p.linear"][0] == status["p.sig"][0] == APPLIED
    assert status["value"][0] == "600"  # both wrappers in the chain


def test_shadowed_wheel_gate_reads_the_imported_checkout(fake, tmp_path):
    """A 0.15 wheel installed, a 0.16.1 checkout in front of it: the checkout's code decides."""
    site = fake.tree("site", version="0.15.0")
    fake.dist_info(site, fake.dist, "0.15.0", owns=True)
    checkout = fake.tree("checkout", version="0.16.1")
    fake.on_path(checkout, site)
    assert gates.installed_version(fake.dist) == "0.15.0"
    found = origin.describe(fake.package, fake.dist)
    assert (found.kind, found.version) == ("checkout", "0.16.1")
    assert found.shadowed == (f"{fake.dist} 0.15.0 at {site / fake.top / 'core'}",)
    status = applied_through_watcher(fake, record(fake))
    assert status["p.linear"][0] == APPLIED


def test_shadowing_checkout_outside_the_range_is_skipped_with_its_path(fake, tmp_path):
    site = fake.tree("site", version="0.16.1")
    fake.dist_info(site, fake.dist, "0.16.1", owns=True)
    checkout = fake.tree("checkout", version="0.17.0")
    fake.on_path(checkout, site)
    status = applied_through_watcher(fake, record(fake))
    assert status["p.linear"][0] == SKIPPED and status["value"][0] == "6"
    detail = status["p.linear"][1]
    assert detail.startswith("version gate:") and "0.17.0" in detail and str(checkout) in detail


def test_bundled_in_another_distribution(fake, tmp_path):
    site = fake.tree("site")
    fake.dist_info(site, "other-rl", "0.0.2", owns=True)
    fake.on_path(site)
    found = origin.describe(fake.package, fake.dist)
    assert (found.kind, found.distribution, found.version) == (
        "bundled",
        "other-rl 0.0.2",
        "0.16.1",
    )


# ------------------------------------------------------------------- pre-releases and forks
def test_prerelease_of_the_supported_line_is_decided_by_the_signature(fake):
    checkout = fake.tree("checkout", version="0.16.0rc0")
    fake.on_path(checkout)
    verdict = gates.judge(fake.gate)
    assert verdict.reason is None and "0.16.0rc0" in verdict.provisional
    status = applied_through_watcher(
        fake,
        record(fake, "with_signature", signature=LINEAR_SIGNATURE),
        record(fake, "without_signature"),
        record(fake, "wrong_signature", signature=Signature(params=("x",))),
    )
    assert status["with_signature"][0] == APPLIED
    assert status["without_signature"][0] == SKIPPED
    assert "pre-release" in status["without_signature"][1]
    assert "no signature" in status["without_signature"][1]
    assert status["wrong_signature"] == (
        SKIPPED,
        f"signature: {fake.package}.layers.linear(input, weight, bias, tp_group) has no "
        "parameter 'x'",
    )
    assert status["value"][0] == "60"  # exactly one wrapper applied


def test_prerelease_of_the_next_line_fails_like_its_release(fake):
    checkout = fake.tree("checkout", version="0.17.0rc0")
    fake.on_path(checkout)
    assert "outside" in gates.judge(fake.gate).reason


def test_fork_with_a_changed_signature_is_skipped_never_half_patched(fake):
    checkout = fake.tree("checkout", version="0.16.1", layers=FORK_LAYERS)
    fake.on_path(checkout)
    method = Patch(
        id="p.method",
        target=f"{fake.package}.layers:Linear._forward_impl",
        replace=lambda orig: lambda self, *a, **k: orig(self, *a, **k) + 1,
        requires=(fake.gate,),
        signature=Signature(positional=("self", "input", "weight"), contains=("linear(input",)),
        rationale="test",
        remove_when="test",
    )
    status = applied_through_watcher(fake, record(fake, signature=LINEAR_SIGNATURE), method)
    assert status["p.linear"][0] == SKIPPED
    assert "has no parameter 'input', 'weight'" in status["p.linear"][1]
    assert status["p.method"][0] == APPLIED  # the other target matches: it is patched
    assert status["value"][0] == "6"  # linear untouched


def test_signature_mismatch_on_one_record_leaves_the_target_chain_consistent(fake):
    """Two records on one target: the non-matching one is left out before any factory runs."""
    checkout = fake.tree("checkout", layers=FORK_LAYERS)
    fake.on_path(checkout)
    calls: list[str] = []

    def factory(tag):
        def make(orig):
            calls.append(tag)
            return lambda *a, **k: orig(*a, **k) * 10

        return make

    good = Patch(
        id="good", target=f"{fake.package}.layers:linear", replace=factory("good"),
        requires=(fake.gate,), signature=Signature(params=("inp", "w")),
        rationale="t", remove_when="t",
    )  # fmt: skip
    bad = Patch(
        id="bad", target=f"{fake.package}.layers:linear", replace=factory("bad"),
        requires=(fake.gate,), signature=LINEAR_SIGNATURE, rationale="t", remove_when="t",
    )  # fmt: skip
    status = applied_through_watcher(fake, good, bad)
    assert calls == ["good"] and status["value"][0] == "60"
    assert status["bad"][0] == SKIPPED and status["good"][0] == APPLIED


def test_strict_turns_a_signature_mismatch_into_an_error(fake, monkeypatch):
    checkout = fake.tree("checkout", layers=FORK_LAYERS)
    fake.on_path(checkout)
    fake.layers()
    monkeypatch.setenv("TITAN_PLUGINS_STRICT", "1")
    with pytest.raises(PatchError, match="signature"):
        PatchEngine().register(record(fake, signature=LINEAR_SIGNATURE))


def test_source_checks_ignore_formatting_and_read_the_module(fake):
    fake.on_path(fake.tree("checkout"))
    layers = fake.layers()
    assert Signature(contains=("out  =  input *\n weight",)).mismatch(layers, "linear") is None
    assert Signature(of=".", contains=("class Linear:",)).mismatch(layers, "x") is None
    assert "contains 'bias'" in Signature(lacks=("bias",)).mismatch(layers, "linear")
    assert "has no Linear.nope" in Signature(attrs=("Linear.nope",)).mismatch(layers, "linear")
    assert "does not start with" in Signature(positional=("weight",)).mismatch(layers, "linear")
    assert "orders" in Signature(params=("weight", "input")).mismatch(layers, "linear")
    assert Signature(positional=("self", "input")).mismatch(layers, "Linear._forward_impl") is None


def test_reload_from_other_code_rejudges(fake):
    """A module re-executed from different code is judged again (skips are not sticky)."""
    checkout = fake.tree("checkout", layers=FORK_LAYERS)
    fake.on_path(checkout)
    engine = PatchEngine()
    watcher = PatchWatcher(engine)
    watcher.install()
    try:
        patch = record(fake, signature=LINEAR_SIGNATURE)
        engine.register(patch)
        layers = fake.layers()
        assert patch.status == SKIPPED
        (checkout / fake.top / "core" / "layers.py").write_text(textwrap.dedent(LAYERS))
        importlib.invalidate_caches()
        sys.modules.pop(f"{fake.package}.layers")
        layers = fake.layers()
        assert patch.status == APPLIED and layers.linear(2, 3) == 60
    finally:
        engine.undo()
        watcher.remove()


@pytest.mark.parametrize(
    ("version", "prerelease"),
    [("0.16.0rc0", True), ("0.17.0.dev1", True), ("0.16.1", False), ("2.13.0+cpu", False)],
)
def test_is_prerelease(version, prerelease):
    assert gates.is_prerelease(version) is prerelease


def test_package_info_is_read_without_executing_it(tmp_path):
    info = tmp_path / "package_info.py"
    info.write_text(
        "raise SystemExit('executed')\nMAJOR = 0\nMINOR = 16\nPATCH = 0\nPRE_RELEASE = 'rc0'\n"
    )
    assert origin.read_package_info(info) == "0.16.0rc0"
    info.write_text("__version__ = '1.2.3'\n")
    assert origin.read_package_info(info) == "1.2.3"


# ------------------------------------------------------------------- doctor and report
def test_doctor_warns_when_a_distribution_is_shadowed(fake):
    from titan_plugins import doctor

    site = fake.tree("site", version="0.15.0")
    fake.dist_info(site, fake.dist, "0.15.0", owns=True)
    checkout = fake.tree("checkout", version="0.16.1")
    fake.on_path(checkout, site)
    found = origin.describe(fake.package, fake.dist)
    main = doctor.check_megatron(found)
    assert main.status == doctor.OK and str(checkout) in main.detail and "checkout" in main.detail
    shadow = doctor.check_megatron_shadowing(found)
    assert shadow.status == doctor.WARN and f"{fake.dist} 0.15.0 at {site}" in shadow.detail
    assert "pip uninstall" in shadow.fix


def test_doctor_on_a_prerelease_and_outside_the_range(fake):
    from titan_plugins import doctor

    rc = origin.Origin("m.core", "/x", "0.16.0rc0", origin.CHECKOUT, False)
    assert doctor.check_megatron(rc).status == doctor.WARN
    assert "pre-release" in doctor.check_megatron(rc).detail
    old = origin.Origin(
        "m.core", "/x", "0.15.2", origin.DISTRIBUTION, False, "megatron-core 0.15.2"
    )
    assert "outside" in doctor.check_megatron(old).detail
    assert doctor.check_megatron_shadowing(old) is None
    absent = origin.Origin("m.core", None, None, origin.ABSENT, False)
    assert "not importable" in doctor.check_megatron(absent).detail


def test_report_says_where_megatron_comes_from():
    """The real environment: the venv's megatron-core wheel (read without importing it)."""
    from titan_plugins import report

    data = report.megatron_origin()
    expected = origin.describe("megatron.core", "megatron-core")
    assert data["path"] == expected.path and data["version"] == expected.version
    assert data["kind"] == expected.kind and data["summary"] == expected.summary()


def test_an_unsupported_megatron_logs_one_line_per_plugin(fake, caplog):
    """0.15 everywhere: every patch of each plugin is skipped, one warning per plugin (the rest
    at debug level), and the report calls each plugin inactive with the reason."""
    import logging

    from titan_plugins.report import _mark_inactive

    checkout = fake.tree("checkout", version="0.15.3")
    fake.on_path(checkout)
    patches = [
        record(fake, f"{plugin}.p{i}", signature=LINEAR_SIGNATURE)
        for plugin in ("alpha", "beta")
        for i in range(3)
    ]
    for patch in patches:
        patch.plugin = patch.id.split(".")[0]
    engine = PatchEngine()
    watcher = PatchWatcher(engine)
    watcher.install()
    try:
        with caplog.at_level(logging.DEBUG, logger="titan_plugins"):
            for patch in patches:
                engine.register(patch, plugin=patch.plugin)
            fake.layers()
    finally:
        engine.undo()
        watcher.remove()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("plugin alpha: patch alpha.p0 skipped: version gate:")
    assert "0.15.3" in warnings[0] and warnings[1].startswith("plugin beta:")
    assert all(p.status == SKIPPED for p in patches)
    entry = {"state": "enabled", "reason": "", "patches": [p.as_dict() for p in patches[:3]]}
    _mark_inactive(entry)
    assert entry["state"] == "inactive" and "0.15.3" in entry["reason"]


def test_a_variant_for_another_supported_line_is_by_design_not_a_skip():
    """On the installed line (0.16 in the 3.11 venv, 0.19 in the 3.12 one) a record written for
    another supported line is reported as such; a gate outside the supported lines is a skip."""
    from titan_plugins.patching import gates

    here = gates.resolve_version("megatron-core")[0]
    line = ".".join(here.split(".")[:2])
    elsewhere = next(x for x in megatron_room.MEGATRON_LINES if x != line)
    said = gates.other_line((megatron_room.megatron_lines(elsewhere, elsewhere),))
    assert said is not None and said.rsplit("this is ", 1)[-1].split("+")[0] == here.split("+")[0]
    assert gates.other_line((megatron_room.megatron_lines(line, line),)) is None  # it holds here
    assert gates.other_line(("megatron-core>=0.30",)) is None
    assert gates.other_line(("megatron-core>=0.16,<0.16.1",)) is None  # not a line gate
    with pytest.raises(ValueError, match="known lines"):
        megatron_room.megatron_lines("0.15")
    assert megatron_room.megatron_lines("0.16", "0.17") == "megatron-core>=0.16,<0.18"
