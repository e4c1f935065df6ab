"""The plugin template generates a working plugin: no placeholder left, its patch applies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from titan_plugins.activation import register_patches
from titan_plugins.manager import get_plugin_manager
from titan_plugins.patching import PatchEngine
from titan_plugins.testing import fake_entry_point

ROOT = Path(__file__).resolve().parents[1]


def test_generator_output_loads_and_patches(tmp_path, monkeypatch):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "new_plugin.py"),
            "my_feature",
            "--into",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    plugin_dir = tmp_path / "my_feature"
    texts = [p.read_text() for p in plugin_dir.rglob("*") if p.is_file()]
    assert not any("PLUGIN_" in t or "PLUGIN-" in t for t in texts)
    assert (plugin_dir / "titan_my_feature" / "plugin.py").is_file()
    assert "my_feature = titan_my_feature.plugin" in (plugin_dir / "setup.cfg").read_text()
    monkeypatch.syspath_prepend(str(plugin_dir))
    for var in ("TITAN_PLUGINS", "TITAN_MY_FEATURE"):
        monkeypatch.delenv(var, raising=False)
    pm = get_plugin_manager(
        entry_points=[fake_entry_point("my_feature", "titan_my_feature.plugin")]
    )
    assert pm.records["my_feature"].state == "enabled"
    import megatron.core.parallel_state as ps

    original = ps.initialize_model_parallel
    engine = PatchEngine()
    register_patches(pm, engine, errors := [])  # the module is imported: applied at once
    try:
        status = {p.id: p.status for p in engine.patches()}
        assert status["my_feature.example"] == "applied" and not errors
        assert ps.initialize_model_parallel.__wrapped__ is original
    finally:
        engine.undo()
    assert ps.initialize_model_parallel is original
