"""Ledger of every installed plugin: entry points load, every patch is documented and gated."""

from __future__ import annotations

from importlib import metadata

import pytest

from titan_plugins.hosts import HOSTS
from titan_plugins.manager import ENTRY_POINT_GROUP
from titan_plugins.patching import Patch, gates

EPS = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def test_torch_backends_entry_point_loads():
    (ep,) = [e for e in metadata.entry_points(group="torch.backends") if e.name == "titan_plugins"]
    assert callable(ep.load())


@pytest.mark.parametrize("ep", EPS, ids=[ep.name for ep in EPS])
def test_plugin_patches_are_documented_and_gated(ep):
    plugin = ep.load()
    records: list[Patch] = []
    register = getattr(plugin, "titan_register_patches", None)
    if register is not None:
        register(register=records.append)
    ids = [p.id for p in records]
    assert len(ids) == len(set(ids)), f"duplicate patch ids in {ep.name}"
    for patch in records:
        assert patch.id.startswith(f"{ep.name}."), patch.id
        assert patch.rationale.strip() and patch.remove_when.strip(), patch.id
        assert patch.upstream.strip(), f"{patch.id}: say which upstream code it changes"
        assert patch.requires, f"{patch.id}: needs a version gate (supported Megatron range)"
        for gate in patch.requires:
            reason = gates.check(gate)
            assert reason is None or "outside" in reason or "not installed" in reason, reason


# every host's release-line gates (megatron_lines, sglang_releases)
_LINE_GATES = {gate for host in HOSTS.values() for gate in host.LINE_GATES}


@pytest.mark.parametrize("ep", EPS, ids=[ep.name for ep in EPS])
def test_plugin_patches_gate_on_supported_megatron_lines_and_match_them(ep):
    """Every plugin patch gates on a span of its host's supported lines (``megatron_lines``,
    ``sglang_releases``) and declares a signature that holds on the installed host wherever its
    gate claims this line (else a supported release, or a pre-release of it, would skip the
    patch). A host that is not installed here (SGLang in a Megatron venv) is checked where it
    is: weight_sync's SGLang patch applies and works in the SGLang leg's engine tests."""
    import importlib

    from titan_plugins.patching import signature

    plugin = ep.load()
    records: list[Patch] = []
    register = getattr(plugin, "titan_register_patches", None)
    if register is not None:
        register(register=records.append)
    for patch in records:
        assert len(patch.requires) == 1 and patch.requires[0] in _LINE_GATES, patch.id
        assert patch.signature, f"{patch.id}: declare what it relies on (Signature)"
        if gates.check(patch.requires[0]) is not None:
            continue  # a variant for another line: checked on that line's run of this test
        top = patch.module.split(".", 1)[0]
        if patch.optional and top not in HOSTS and importlib.util.find_spec(top) is None:
            continue  # a framework's checkout, not installed here: checked by its opt-in test
        module = importlib.import_module(patch.module)
        assert signature.check_all(patch.signature, module, patch.attr_path) is None, patch.id
