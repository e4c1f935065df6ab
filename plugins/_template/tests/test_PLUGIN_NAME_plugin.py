"""Start here: the plugin's patches apply through the real engine and undo cleanly."""

from titan_plugins.testing import plugin_active


def test_patches_apply_and_undo():
    import megatron.core.parallel_state as ps

    original = ps.initialize_model_parallel
    with plugin_active("PLUGIN_NAME") as engine:
        assert {p.status for p in engine.patches() if p.plugin == "PLUGIN_NAME"} == {"applied"}
        assert ps.initialize_model_parallel is not original
    assert ps.initialize_model_parallel is original
